//! `castellan upgrade export`: copies the PostgreSQL installation of this (the old)
//! image into a directory the new image's container shares, so that pg_upgrade there
//! has both majors' programs (CloudNativePG's way too).
//!
//! Absolute paths are kept under the target (`/usr/lib/postgresql/15/bin` →
//! `/old/usr/lib/postgresql/15/bin`): PostgreSQL finds its `share` and `lib`
//! directories relative to its own bin directory, by the paths it was built with, so
//! Debian's split layout (`/usr/lib/postgresql/15/{bin,lib}` and
//! `/usr/share/postgresql/15`) works from the copy as long as both move together.
//! What to copy comes from `pg_config` beside `postgres` (its `--bindir`, the parent of
//! that, `--pkglibdir` and `--sharedir`); an installation without one (the dev nodes'
//! composed 18, which leaves it out) is taken to be relocatable: its bin directory's
//! parent. Modes and symlinks are kept.
//!
//! The new image's container runs these programs, and its operating system may not have
//! their libraries: the libraries they need (but glibc's own) are copied too, into
//! `DIR/lib` (`libraries`), and `upgrade run` runs the old programs with them.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use crate::instance::bootstrap::{self, Binaries};
use crate::instance::version;

use super::libraries::{self, LIBRARIES_DIR};

/// The file in the target directory that names the copied bin directory.
pub const BINDIR_FILE: &str = "bindir";

/// Copies the installation whose `postgres` is in `bin_dir` (or first on PATH) into
/// `target`; returns what it did.
pub async fn export(target: &Path, bin_dir: Option<&Path>) -> anyhow::Result<String> {
    let bin_dir = match bin_dir {
        Some(dir) => dir.to_path_buf(),
        None => on_path("postgres").context("finding postgres on PATH")?,
    };
    let bin_dir = tokio::fs::canonicalize(&bin_dir)
        .await
        .with_context(|| format!("resolving {}", bin_dir.display()))?;
    let binaries = Binaries {
        bin_dir: Some(bin_dir.clone()),
    };
    let release = version::release(&binaries)
        .await
        .with_context(|| format!("running {}/postgres --version", bin_dir.display()))?;
    let roots = installation(&bin_dir).await?;
    let copied_bin_dir = under(target, &bin_dir);
    let bindir_file = target.join(BINDIR_FILE);
    let libraries_dir = target.join(LIBRARIES_DIR);
    let named = copied_bin_dir.to_string_lossy().into_owned();
    // Idempotent: a finished export (the bindir file is written last) is kept.
    let libraries = if tokio::fs::read_to_string(&bindir_file)
        .await
        .is_ok_and(|text| text.trim() == named)
        && copied_bin_dir.join("postgres").exists()
        && libraries_dir.is_dir()
    {
        tracing::info!(target = %target.display(), "export: done already");
        None
    } else {
        let _ = tokio::fs::remove_file(&bindir_file).await;
        for root in &roots {
            let copy = under(target, root);
            tracing::info!(from = %root.display(), to = %copy.display(), "export: copying");
            let (root, copy) = (root.clone(), copy.clone());
            tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
                if std::fs::symlink_metadata(&copy).is_ok() {
                    std::fs::remove_dir_all(&copy)
                        .with_context(|| format!("removing the earlier copy {}", copy.display()))?;
                }
                if let Some(parent) = copy.parent() {
                    std::fs::create_dir_all(parent)
                        .with_context(|| format!("creating {}", parent.display()))?;
                }
                copy_tree(&root, &copy)
            })
            .await
            .context("copying the installation")??;
        }
        // Found where the loader finds them, in this image: from the originals.
        let (from, to) = (roots.clone(), libraries_dir.clone());
        let (count, bytes) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
            let closure = libraries::closure(&from)
                .context("finding the libraries the installation's programs need")?;
            let bytes = libraries::copy(&closure, &to)?;
            Ok((closure.len(), bytes))
        })
        .await
        .context("copying the libraries")??;
        tracing::info!(count, bytes, to = %libraries_dir.display(), "export: copied the libraries");
        // The copy must run where it is, with the copied libraries first as in the new
        // image: its share directory where its bin directory expects it.
        let copied = Binaries {
            bin_dir: Some(copied_bin_dir.clone()),
        };
        let copied_release = copied
            .run(
                "postgres",
                &["--version"],
                &[("LD_LIBRARY_PATH", libraries_dir.as_path())],
            )
            .await
            .map(|output| version::release_of(&output).unwrap_or_else(|| output.trim().to_owned()))
            .with_context(|| {
                format!(
                    "running the copied {}/postgres --version with {} as its library path",
                    copied_bin_dir.display(),
                    libraries_dir.display()
                )
            })?;
        if copied_release != release {
            bail!(
                "the copy in {} says PostgreSQL {copied_release}, the original {release}",
                copied_bin_dir.display()
            );
        }
        bootstrap::write_atomically(&bindir_file, &format!("{named}\n"), 0o644)
            .await
            .with_context(|| format!("writing {}", bindir_file.display()))?;
        Some((count, bytes))
    };
    let roots: Vec<String> = roots.iter().map(|r| r.display().to_string()).collect();
    let libraries = libraries.map_or_else(String::new, |(count, bytes)| {
        format!(
            " and the {count} libraries its programs need ({} MB)",
            bytes / 1_000_000
        )
    });
    Ok(format!(
        "copied PostgreSQL {release} ({}){libraries} into {}; {} names its programs' \
         directory, {named}; {} holds the libraries",
        roots.join(", "),
        target.display(),
        bindir_file.display(),
        libraries_dir.display()
    ))
}

/// The first directory on PATH that holds `program`.
fn on_path(program: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .find(|dir| dir.join(program).is_file())
        .with_context(|| {
            format!(
                "no {program} in any directory of PATH ({})",
                path.to_string_lossy()
            )
        })
}

/// The directories that make up the installation whose bin directory is `bin_dir`,
/// none inside another.
async fn installation(bin_dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let parent = bin_dir
        .parent()
        .with_context(|| format!("{} has no parent directory", bin_dir.display()))?
        .to_path_buf();
    let mut roots = vec![parent];
    if bin_dir.join("pg_config").is_file() {
        let binaries = Binaries {
            bin_dir: Some(bin_dir.to_path_buf()),
        };
        let output = binaries
            .run("pg_config", &["--bindir", "--pkglibdir", "--sharedir"], &[])
            .await
            .with_context(|| format!("running {}/pg_config", bin_dir.display()))?;
        let lines: Vec<PathBuf> = output
            .lines()
            .map(|line| PathBuf::from(line.trim()))
            .collect();
        match lines.as_slice() {
            [built_bindir, pkglibdir, sharedir]
                if tokio::fs::canonicalize(built_bindir).await.ok().as_deref() == Some(bin_dir) =>
            {
                for dir in [pkglibdir, sharedir] {
                    roots.push(tokio::fs::canonicalize(dir).await.with_context(|| {
                        format!("resolving {} (from pg_config)", dir.display())
                    })?);
                }
            }
            _ => tracing::info!(
                bin_dir = %bin_dir.display(),
                pg_config = %output.trim(),
                "export: pg_config describes another installation; copying the bin directory's parent"
            ),
        }
    }
    Ok(outermost(roots))
}

/// `dirs` without duplicates and without any directory inside another.
fn outermost(mut dirs: Vec<PathBuf>) -> Vec<PathBuf> {
    dirs.sort();
    dirs.dedup();
    let mut kept: Vec<PathBuf> = Vec::new();
    for dir in dirs {
        if !kept.iter().any(|outer| dir.starts_with(outer)) {
            kept.push(dir);
        }
    }
    kept
}

/// `path` (absolute) re-rooted under `target`.
fn under(target: &Path, path: &Path) -> PathBuf {
    target.join(path.strip_prefix("/").unwrap_or(path))
}

/// Copies a tree: directories, files with their modes, symlinks as they are (a
/// relative link inside the tree keeps pointing inside the copy). Sockets and other
/// special files are left out.
fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    let meta = std::fs::symlink_metadata(from)
        .with_context(|| format!("inspecting {}", from.display()))?;
    let kind = meta.file_type();
    if kind.is_symlink() {
        let link = std::fs::read_link(from)
            .with_context(|| format!("reading the link {}", from.display()))?;
        std::os::unix::fs::symlink(&link, to)
            .with_context(|| format!("linking {} to {}", to.display(), link.display()))?;
    } else if kind.is_dir() {
        std::fs::create_dir(to).with_context(|| format!("creating {}", to.display()))?;
        for entry in
            std::fs::read_dir(from).with_context(|| format!("listing {}", from.display()))?
        {
            let entry = entry.with_context(|| format!("listing {}", from.display()))?;
            copy_tree(&entry.path(), &to.join(entry.file_name()))?;
        }
        // After the children: a read-only directory still gets them.
        std::fs::set_permissions(to, meta.permissions())
            .with_context(|| format!("setting the mode of {}", to.display()))?;
    } else if kind.is_file() {
        // std::fs::copy keeps the permission bits.
        std::fs::copy(from, to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debians_split_layout_is_copied_once_each() {
        let roots = outermost(vec![
            "/usr/lib/postgresql/15".into(),
            "/usr/lib/postgresql/15/lib".into(),
            "/usr/share/postgresql/15".into(),
            "/usr/share/postgresql/15".into(),
        ]);
        assert_eq!(
            roots,
            vec![
                PathBuf::from("/usr/lib/postgresql/15"),
                PathBuf::from("/usr/share/postgresql/15")
            ]
        );
        // A sibling whose name starts alike is not inside.
        assert_eq!(
            outermost(vec!["/opt/pg".into(), "/opt/pg18".into()]).len(),
            2
        );
    }

    #[test]
    fn absolute_paths_are_kept_under_the_target() {
        assert_eq!(
            under(Path::new("/old"), Path::new("/usr/lib/postgresql/15/bin")),
            PathBuf::from("/old/usr/lib/postgresql/15/bin")
        );
    }

    #[test]
    fn a_tree_is_copied_with_modes_and_links() {
        use std::os::unix::fs::PermissionsExt;
        let scratch = std::env::temp_dir().join(format!("castellan-export-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&scratch);
        let source = scratch.join("src");
        std::fs::create_dir_all(source.join("bin")).expect("mkdir");
        std::fs::write(source.join("bin/postgres"), "#!/bin/sh\n").expect("write");
        std::fs::set_permissions(
            source.join("bin/postgres"),
            std::fs::Permissions::from_mode(0o751),
        )
        .expect("chmod");
        std::os::unix::fs::symlink("postgres", source.join("bin/postmaster")).expect("symlink");
        let copy = scratch.join("copy");
        copy_tree(&source, &copy).expect("copied");
        let mode = std::fs::metadata(copy.join("bin/postgres"))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o751);
        assert_eq!(
            std::fs::read_link(copy.join("bin/postmaster")).expect("link"),
            PathBuf::from("postgres")
        );
        let _ = std::fs::remove_dir_all(&scratch);
    }
}
