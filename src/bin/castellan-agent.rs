//! `castellan-agent`: the agent alone, with the command line of `castellan agent`;
//! `castellan agent` executes this binary when it is installed beside it.
#![forbid(unsafe_code)]

fn main() -> anyhow::Result<()> {
    castellan::role_main(castellan::Role::Agent)
}
