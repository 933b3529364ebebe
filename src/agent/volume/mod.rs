//! Local volumes of a pool: what a claim gets (`machine`, pure) and the provisioner that
//! makes, grows and releases them (`shell`).

pub mod machine;
pub mod shell;
