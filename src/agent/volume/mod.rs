//! Local volumes of a pool: what a claim gets (`machine`, pure), the provisioner that
//! makes, grows and releases them (`shell`), and the `VolumeActor` that runs it one
//! pass at a time (`actor`).

pub mod actor;
pub mod machine;
pub mod shell;
