//! The old installation's shared libraries, so that its programs run in the NEW image's
//! container, whose operating system may be a later release that has none of them
//! (bookworm's PostgreSQL 15 links libicu72 and libldap-2.5; forky, under 18, has
//! libicu76 and libldap2).
//!
//! - `export` (OLD image): [`closure`] follows the DT_NEEDED entries of every ELF file of
//!   the installation, and of every library they name, as the dynamic loader resolves
//!   them there (DT_RPATH, LD_LIBRARY_PATH, DT_RUNPATH, then the directories of
//!   `/etc/ld.so.conf`, from which its cache is made, and the built-in ones); [`copy`]
//!   puts each into `DIR/lib` under the name it is needed by. The ELF files are read
//!   with `object`, so the old image needs no `ldd` (nor a shell).
//! - `run` (NEW image): [`wrap`] writes, for each old program, a script in
//!   `DIR/programs` that runs it with `LD_LIBRARY_PATH=DIR/lib`, and pg_upgrade gets
//!   that directory as its old bindir. pg_upgrade starts every program, its own major's
//!   too, with its own environment: `LD_LIBRARY_PATH` on pg_upgrade would give the new
//!   server and pg_dump bookworm's libssl3 and libpq5 (same sonames, older versions).
//!   Through the scripts only the old programs, and the old server the old `pg_ctl`
//!   starts, see the old libraries.
//!
//! glibc's own libraries ([`is_c_library`]) are never copied: they are one build,
//! bound to each other by GLIBC_PRIVATE interfaces (an old libm.so.6 beside a newer
//! libc.so.6 may not load), and the new image's glibc, at least as new as the old
//! one's, serves the old programs through symbol versioning. Libraries loaded with
//! dlopen by a library (OpenSSL's providers, SASL and Kerberos plugins, NSS modules)
//! are not followed: pg_upgrade's old server runs without TLS and with local trust
//! connections only. PostgreSQL's own modules (`pkglibdir`, dlopened by the server)
//! are ELF files of the installation, so theirs are followed, but for the JIT provider's
//! ([`is_jit_provider`]: the old server runs with `jit=off`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use object::read::elf::{FileHeader, ProgramHeader};
use object::{Endianness, elf};

/// `DIR/lib`: the old installation's libraries, each under the name it is needed by.
pub const LIBRARIES_DIR: &str = "lib";
/// `DIR/programs`: the old programs as `upgrade run` runs them (written there).
pub const PROGRAMS_DIR: &str = "programs";

/// Whether `soname` is one of the libraries glibc itself installs (the same in
/// bookworm's 2.36 and forky's 2.43), which the new image's glibc provides.
pub fn is_c_library(soname: &str) -> bool {
    const GLIBC: &[&str] = &[
        "libc.so.6",
        "libm.so.6",
        "libmvec.so.1",
        "libpthread.so.0",
        "libdl.so.2",
        "librt.so.1",
        "libresolv.so.2",
        "libutil.so.1",
        "libanl.so.1",
        "libnsl.so.1",
        "libBrokenLocale.so.1",
        "libthread_db.so.1",
        "libc_malloc_debug.so.0",
        "libmemusage.so",
        "libpcprofile.so",
        "libnss_files.so.2",
        "libnss_dns.so.2",
        "libnss_compat.so.2",
        "libnss_hesiod.so.2",
    ];
    // The dynamic loader under its names on each architecture (ld-linux-x86-64.so.2,
    // ld-linux-aarch64.so.1, ld64.so.2 …).
    soname.starts_with("ld-linux") || soname.starts_with("ld64.so.") || GLIBC.contains(&soname)
}

/// What the dynamic loader reads of an ELF object.
#[derive(Debug, Default, PartialEq, Eq)]
struct Dynamic {
    /// 64-bit, and the machine: the loader skips a library of another kind.
    kind: (bool, u16),
    needed: Vec<String>,
    runpath: Vec<String>,
    rpath: Vec<String>,
}

/// The dynamic section of `data`, or `None` when it is not an ELF file (a script, a
/// bitcode file). A statically linked file needs nothing.
fn read_dynamic(data: &[u8]) -> anyhow::Result<Option<Dynamic>> {
    match object::FileKind::parse(data) {
        Ok(object::FileKind::Elf32) => dynamic_of::<elf::FileHeader32<Endianness>>(data).map(Some),
        Ok(object::FileKind::Elf64) => dynamic_of::<elf::FileHeader64<Endianness>>(data).map(Some),
        _ => Ok(None),
    }
}

fn dynamic_of<Elf: FileHeader<Endian = Endianness>>(data: &[u8]) -> anyhow::Result<Dynamic> {
    let header = Elf::parse(data)?;
    let endian = header.endian()?;
    let table = header.sections(endian, data)?.dynamic_table(endian, data)?;
    let mut dynamic = Dynamic {
        kind: (header.is_class_64(), header.e_machine(endian)),
        ..Dynamic::default()
    };
    if table.is_empty()
        && header
            .program_headers(endian, data)?
            .iter()
            .any(|segment| segment.p_type(endian) == elf::PT_DYNAMIC)
    {
        // The loader reads the dynamic segment; without section headers (sstrip) this
        // reader finds no strings for it. Refused rather than taken as needing nothing.
        bail!("it has a dynamic segment but no section headers to read it with");
    }
    for entry in &table {
        let list = match entry.tag {
            elf::DT_NEEDED => &mut dynamic.needed,
            elf::DT_RUNPATH => &mut dynamic.runpath,
            elf::DT_RPATH => &mut dynamic.rpath,
            _ => continue,
        };
        let value = String::from_utf8_lossy(table.string(entry)?).into_owned();
        if entry.tag == elf::DT_NEEDED {
            list.push(value);
        } else {
            list.extend(
                value
                    .split(':')
                    .filter(|dir| !dir.is_empty())
                    .map(String::from),
            );
        }
    }
    Ok(dynamic)
}

/// The directories the loader searches, in order, for a library that `object` (in
/// directory `origin`) needs: DT_RPATH (only when there is no DT_RUNPATH),
/// LD_LIBRARY_PATH, DT_RUNPATH, then the system's. `$ORIGIN` is the object's directory.
/// (The loader also searches the executable's DT_RPATH for its libraries' needs;
/// PostgreSQL's builds set DT_RUNPATH or nothing.)
fn search_path(
    object: &Dynamic,
    origin: &Path,
    ld_library_path: &[PathBuf],
    system: &[PathBuf],
) -> Vec<PathBuf> {
    let expand = |dirs: &[String]| -> Vec<PathBuf> {
        let origin = origin.to_string_lossy();
        dirs.iter()
            .map(|dir| {
                PathBuf::from(
                    dir.replace("${ORIGIN}", &origin)
                        .replace("$ORIGIN", &origin),
                )
            })
            .collect()
    };
    let mut dirs = Vec::new();
    if object.runpath.is_empty() {
        dirs.extend(expand(&object.rpath));
    }
    dirs.extend(ld_library_path.iter().cloned());
    dirs.extend(expand(&object.runpath));
    dirs.extend(system.iter().cloned());
    dirs
}

/// A line of ld.so.conf that matters here.
#[derive(Debug, PartialEq, Eq)]
enum ConfLine {
    Dir(PathBuf),
    /// A file pattern, `*` only in its last component (`/etc/ld.so.conf.d/*.conf`).
    Include(String),
}

fn parse_ld_so_conf(text: &str) -> Vec<ConfLine> {
    text.lines()
        .map(|line| line.split('#').next().unwrap_or_default().trim())
        .filter(|line| !line.is_empty())
        .flat_map(|line| match line.strip_prefix("include") {
            Some(rest) if rest.starts_with(char::is_whitespace) => rest
                .split_whitespace()
                .map(|pattern| ConfLine::Include(pattern.to_owned()))
                .collect::<Vec<_>>(),
            // `hwcap` lines are gone from glibc; anything else is a directory (old
            // files may name several on a line, or add `=TYPE`).
            _ if line.starts_with("hwcap") => Vec::new(),
            _ => line
                .split([' ', '\t', ',', ':'])
                .filter(|dir| dir.starts_with('/'))
                .map(|dir| ConfLine::Dir(PathBuf::from(dir.split('=').next().unwrap_or(dir))))
                .collect(),
        })
        .collect()
}

/// Whether the file name `name` matches `pattern`, whose only wildcards are `*`.
fn matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((prefix, rest)) => {
            let Some(tail) = name.strip_prefix(prefix) else {
                return false;
            };
            (0..=tail.len())
                .filter(|&at| tail.is_char_boundary(at))
                .any(|at| matches(rest, &tail[at..]))
        }
    }
}

/// The system's library directories: those of `conf` (ld.so.conf and what it includes,
/// in order), then glibc's built-in ones.
fn system_dirs(conf: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut seen = BTreeSet::new();
    read_conf(conf, &mut dirs, &mut seen);
    for dir in ["/lib64", "/usr/lib64", "/lib", "/usr/lib"] {
        dirs.push(PathBuf::from(dir));
    }
    dirs
}

fn read_conf(file: &Path, dirs: &mut Vec<PathBuf>, seen: &mut BTreeSet<PathBuf>) {
    // An include cycle is read once; a missing file (no ld.so.conf at all) adds nothing.
    if !seen.insert(file.to_path_buf()) {
        return;
    }
    let Ok(text) = std::fs::read_to_string(file) else {
        return;
    };
    let base = file.parent().unwrap_or(Path::new("/"));
    for line in parse_ld_so_conf(&text) {
        match line {
            ConfLine::Dir(dir) => dirs.push(dir),
            ConfLine::Include(pattern) => {
                let pattern = base.join(pattern);
                let (Some(dir), Some(name)) = (pattern.parent(), pattern.file_name()) else {
                    continue;
                };
                let name = name.to_string_lossy();
                let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter(|entry| matches(&name, &entry.file_name().to_string_lossy()))
                    .map(|entry| entry.path())
                    .collect();
                files.sort();
                for included in files {
                    read_conf(&included, dirs, seen);
                }
            }
        }
    }
}

/// The ELF file at `path`, if it is one.
fn read_object(path: &Path) -> anyhow::Result<Option<Dynamic>> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    if file.read_exact(&mut magic).is_err() || &magic != b"\x7fELF" {
        return Ok(None);
    }
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    read_dynamic(&data).with_context(|| format!("reading the ELF file {}", path.display()))
}

/// The regular files under `root`, symlinks not followed (a link inside the tree names
/// a file that is listed anyway).
fn files_under(root: &Path, files: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(root).with_context(|| format!("listing {}", root.display()))? {
        let entry = entry.with_context(|| format!("listing {}", root.display()))?;
        let kind = entry
            .file_type()
            .with_context(|| format!("inspecting {}", entry.path().display()))?;
        if kind.is_dir() {
            files_under(&entry.path(), files)?;
        } else if kind.is_file() {
            files.push(entry.path());
        }
    }
    Ok(())
}

/// PostgreSQL's JIT provider (`llvmjit.so`), whose LLVM (and z3) are three quarters
/// of what the old installation would need: pg_upgrade's old server runs with
/// `jit=off` (`upgrade run`), so it is never loaded, and its libraries are not copied.
fn is_jit_provider(file: &Path) -> bool {
    file.file_name()
        .and_then(|name| name.to_str())
        .is_some_and(|name| name.starts_with("llvmjit") && name.ends_with(".so"))
}

/// The libraries the ELF files under `roots` need, directly or through each other,
/// glibc's own left out: each name as needed, with the file the loader would open in
/// this image. Every name must be found.
pub fn closure(roots: &[PathBuf]) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let system = system_dirs(Path::new("/etc/ld.so.conf"));
    let ld_library_path: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|paths| {
            std::env::split_paths(&paths)
                .filter(|p| !p.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default();
    let mut files = Vec::new();
    for root in roots {
        files_under(root, &mut files)?;
    }
    let mut pending = Vec::new();
    for file in files.into_iter().filter(|file| !is_jit_provider(file)) {
        if let Some(dynamic) = read_object(&file)? {
            pending.push((file, dynamic));
        }
    }
    let mut found: BTreeMap<String, PathBuf> = BTreeMap::new();
    while let Some((object, dynamic)) = pending.pop() {
        let origin = object.parent().unwrap_or(Path::new("/"));
        for needed in &dynamic.needed {
            if is_c_library(needed) || found.contains_key(needed) {
                continue;
            }
            let dirs = search_path(&dynamic, origin, &ld_library_path, &system);
            let (library, its) = resolve(needed, dynamic.kind, &dirs)
                .with_context(|| format!("finding {needed}, which {} needs", object.display()))?;
            found.insert(needed.clone(), library.clone());
            pending.push((library, its));
        }
    }
    Ok(found)
}

/// The first file named `needed` in `dirs` that is an ELF object of `kind`.
fn resolve(
    needed: &str,
    kind: (bool, u16),
    dirs: &[PathBuf],
) -> anyhow::Result<(PathBuf, Dynamic)> {
    let candidates: Vec<PathBuf> = if needed.contains('/') {
        vec![PathBuf::from(needed)]
    } else {
        dirs.iter().map(|dir| dir.join(needed)).collect()
    };
    for candidate in candidates {
        if !candidate.is_file() {
            continue;
        }
        if let Some(dynamic) = read_object(&candidate)?
            && dynamic.kind == kind
        {
            return Ok((candidate, dynamic));
        }
    }
    let dirs: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    bail!(
        "the dynamic loader would not find it either: it is in none of {}",
        dirs.join(":")
    )
}

/// Copies each library of `closure` into `dir` under the name it is needed by (the
/// file, not a link to it), keeping its mode.
pub fn copy(closure: &BTreeMap<String, PathBuf>, dir: &Path) -> anyhow::Result<u64> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut bytes = 0;
    for (soname, library) in closure {
        let copy = dir.join(soname);
        // A copy from a stopped export may be there, read-only.
        let _ = std::fs::remove_file(&copy);
        bytes += std::fs::copy(library, &copy)
            .with_context(|| format!("copying {} to {}", library.display(), copy.display()))?;
    }
    Ok(bytes)
}

/// The script that runs `program` with `libraries` (and then the system's) as its
/// library path.
fn wrapper(program: &Path, libraries: &Path) -> String {
    format!(
        "#!/bin/sh\n\
         # castellan upgrade run: the old PostgreSQL's program with the libraries of its\n\
         # own image, which `castellan upgrade export` copied (docs/upgrade-pod.md).\n\
         LD_LIBRARY_PATH={}\n\
         export LD_LIBRARY_PATH\n\
         exec {} \"$@\"\n",
        quote(&libraries.to_string_lossy()),
        quote(&program.to_string_lossy())
    )
}

/// `text` as one word for sh.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// Writes a script into `programs` for each program in `bin_dir` that runs it with
/// `libraries` on its library path (made afresh, so that a re-run never keeps a script
/// of another export). The programs keep their own paths: PostgreSQL finds its share
/// and lib directories, and `pg_ctl` its `postgres`, from them.
pub fn wrap(bin_dir: &Path, libraries: &Path, programs: &Path) -> anyhow::Result<usize> {
    use std::os::unix::fs::PermissionsExt;
    if !libraries.is_dir() {
        bail!(
            "{} is missing: the old installation's libraries are copied there by \
             `castellan upgrade export` (was it an older version's?)",
            libraries.display()
        );
    }
    if std::fs::symlink_metadata(programs).is_ok() {
        std::fs::remove_dir_all(programs)
            .with_context(|| format!("removing the earlier {}", programs.display()))?;
    }
    std::fs::create_dir_all(programs)
        .with_context(|| format!("creating {}", programs.display()))?;
    let mut count = 0;
    for entry in
        std::fs::read_dir(bin_dir).with_context(|| format!("listing {}", bin_dir.display()))?
    {
        let entry = entry.with_context(|| format!("listing {}", bin_dir.display()))?;
        let program = entry.path();
        let executable = std::fs::metadata(&program)
            .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0);
        if !executable {
            continue;
        }
        let script = programs.join(entry.file_name());
        std::fs::write(&script, wrapper(&program, libraries))
            .with_context(|| format!("writing {}", script.display()))?;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
            .with_context(|| format!("making {} executable", script.display()))?;
        count += 1;
    }
    Ok(count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glibcs_own_libraries_are_left_to_the_new_image() {
        for soname in [
            "libc.so.6",
            "libm.so.6",
            "libpthread.so.0",
            "libdl.so.2",
            "librt.so.1",
            "ld-linux-x86-64.so.2",
            "ld-linux-aarch64.so.1",
        ] {
            assert!(is_c_library(soname), "{soname}");
        }
        // Not glibc's: libxcrypt's, GCC's, and what bookworm's 15 needs that forky lacks.
        for soname in [
            "libcrypt.so.1",
            "libgcc_s.so.1",
            "libstdc++.so.6",
            "libicuuc.so.72",
            "libldap-2.5.so.0",
            "libssl.so.3",
        ] {
            assert!(!is_c_library(soname), "{soname}");
        }
    }

    #[test]
    fn this_test_programs_needs_are_read() {
        let exe = std::env::current_exe().expect("the test binary's path");
        let dynamic = read_object(&exe)
            .expect("read")
            .expect("the test binary is an ELF file");
        assert!(
            dynamic.needed.iter().any(|n| n == "libc.so.6"),
            "{dynamic:?}"
        );
        assert_eq!(dynamic.kind.0, cfg!(target_pointer_width = "64"));
        assert_eq!(read_dynamic(b"#!/bin/sh\n").expect("not ELF"), None);
    }

    #[test]
    fn the_search_path_is_the_loaders() {
        let system = vec![PathBuf::from("/usr/lib/x86_64-linux-gnu")];
        let env = vec![PathBuf::from("/env")];
        let origin = Path::new("/opt/pg/bin");
        let runpath = Dynamic {
            runpath: vec!["$ORIGIN/../lib".into()],
            rpath: vec!["/ignored".into()],
            ..Dynamic::default()
        };
        assert_eq!(
            search_path(&runpath, origin, &env, &system),
            ["/env", "/opt/pg/bin/../lib", "/usr/lib/x86_64-linux-gnu"].map(PathBuf::from)
        );
        let rpath = Dynamic {
            rpath: vec!["${ORIGIN}/lib".into()],
            ..Dynamic::default()
        };
        assert_eq!(
            search_path(&rpath, origin, &env, &system),
            ["/opt/pg/bin/lib", "/env", "/usr/lib/x86_64-linux-gnu"].map(PathBuf::from)
        );
    }

    #[test]
    fn ld_so_conf_as_debian_writes_it() {
        let conf = "include /etc/ld.so.conf.d/*.conf\n\n# Multiarch support\n\
                    /usr/local/lib/x86_64-linux-gnu\n/lib/x86_64-linux-gnu # trailing\n";
        assert_eq!(
            parse_ld_so_conf(conf),
            vec![
                ConfLine::Include("/etc/ld.so.conf.d/*.conf".into()),
                ConfLine::Dir("/usr/local/lib/x86_64-linux-gnu".into()),
                ConfLine::Dir("/lib/x86_64-linux-gnu".into()),
            ]
        );
        assert!(matches("*.conf", "x86_64-linux-gnu.conf"));
        assert!(matches("*.conf", ".conf"));
        assert!(!matches("*.conf", "libc.conf.bak"));
        assert!(matches("lib*", "lib"));
    }

    #[test]
    fn the_jit_providers_libraries_are_not_followed() {
        assert!(is_jit_provider(Path::new(
            "/usr/lib/postgresql/15/lib/llvmjit.so"
        )));
        assert!(!is_jit_provider(Path::new(
            "/usr/lib/postgresql/15/lib/llvmjit_types.bc"
        )));
        assert!(!is_jit_provider(Path::new(
            "/usr/lib/postgresql/15/lib/plpgsql.so"
        )));
    }

    #[test]
    fn a_wrapper_runs_the_program_with_the_old_libraries_only() {
        let script = wrapper(
            Path::new("/old/usr/lib/postgresql/15/bin/pg_ctl"),
            Path::new("/old/it's/lib"),
        );
        assert_eq!(
            script.lines().skip(3).collect::<Vec<_>>(),
            [
                r"LD_LIBRARY_PATH='/old/it'\''s/lib'",
                "export LD_LIBRARY_PATH",
                r#"exec '/old/usr/lib/postgresql/15/bin/pg_ctl' "$@""#,
            ]
        );
    }
}
