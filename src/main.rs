//! `castellan`: Castellan's processes and tools as subcommands (`castellan --help`).
#![forbid(unsafe_code)]

fn main() -> anyhow::Result<()> {
    castellan::main()
}
