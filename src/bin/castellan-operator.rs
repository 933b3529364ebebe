//! `castellan-operator`: the operator alone, with the command line of `castellan operator`;
//! `castellan operator` executes this binary when it is installed beside it.
#![forbid(unsafe_code)]

fn main() -> anyhow::Result<()> {
    castellan::role_main(castellan::Role::Operator)
}
