//! What /proc says of a running process: which executable it runs, its environment and
//! its arguments (how Castellan's processes start themselves again).

/// The file name of the executable process `pid` runs.
pub fn executable(pid: u32) -> String {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
        .unwrap_or_else(|e| panic!("reading process {pid}'s executable: {e}"));
    exe.file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Whether process `pid`'s environment holds `var` (`NAME=value`).
pub fn has_env(pid: u32, var: &str) -> bool {
    entries(pid, "environ")
        .iter()
        .any(|entry| entry == var.as_bytes())
}

/// Whether one of process `pid`'s arguments is `arg`.
pub fn has_arg(pid: u32, arg: &str) -> bool {
    entries(pid, "cmdline")
        .iter()
        .any(|entry| entry == arg.as_bytes())
}

/// The NUL-separated entries of `/proc/<pid>/<file>`.
fn entries(pid: u32, file: &str) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(format!("/proc/{pid}/{file}"))
        .unwrap_or_else(|e| panic!("reading process {pid}'s {file}: {e}"));
    bytes.split(|b| *b == 0).map(<[u8]>::to_vec).collect()
}
