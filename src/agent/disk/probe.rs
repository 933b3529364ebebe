//! Probe: the signatures written on a device — partition tables, filesystems, RAID,
//! LVM and crypto headers — found by `wipefs --no-act` (util-linux), which lists every
//! magic it recognises, not only the first one as `blkid` does.
//!
//! It only reads: `--no-act` is what makes `wipefs` a prober, and nothing else here
//! may ever run it without that flag.

use std::path::Path;
use std::process::Command;

use serde::Deserialize;

/// What a signature says the device is used as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignatureKind {
    PartitionTable,
    Filesystem,
    /// A RAID member (md, hardware RAID metadata) or an LVM physical volume: libblkid
    /// calls both "raid".
    Raid,
    Crypto,
    /// Anything else, such as swap.
    Other,
}

/// One signature on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Signature {
    /// libblkid's name, such as `gpt`, `ext4`, `linux_raid_member`, `LVM2_member`.
    pub name: String,
    pub kind: SignatureKind,
    /// The filesystem's (or array's) UUID, shared by all devices of a multi-device one.
    pub uuid: Option<String>,
    /// The UUID of this device within a multi-device filesystem (`UUID_SUB`: btrfs,
    /// md RAID): what tells the disks of one Castellan pool apart.
    pub device_uuid: Option<String>,
    pub label: Option<String>,
}

/// Why probing failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("running wipefs --no-act on {device}: {source}")]
    Spawn {
        device: String,
        source: std::io::Error,
    },
    #[error("probing {device} with wipefs ({status}): {stderr}")]
    Failed {
        device: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    #[error("reading wipefs output for {device}: {source}")]
    Parse {
        device: String,
        source: serde_json::Error,
    },
}

/// Probes `device` (a path under `/dev`).
pub fn probe(device: &Path) -> Result<Vec<Signature>, ProbeError> {
    let mut signatures = probe_signatures(device)?;
    if signatures.iter().any(|signature| signature.uuid.is_some()) {
        // wipefs does not print `UUID_SUB`; blkid does, but for one signature only,
        // so it is asked only to complete what wipefs found. Failing here leaves the
        // sub-UUID unknown, which only costs identity for disks without a serial.
        if let Some((kind, device_uuid)) = probe_device_uuid(device) {
            for signature in signatures
                .iter_mut()
                .filter(|signature| signature.name == kind)
            {
                signature.device_uuid = Some(device_uuid.clone());
            }
        }
    }
    Ok(signatures)
}

/// `(TYPE, UUID_SUB)` from `blkid -p -o export`, if it prints both.
fn probe_device_uuid(device: &Path) -> Option<(String, String)> {
    let output = Command::new("blkid")
        .args(["--probe", "--output", "export"])
        .arg(device)
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| parse_blkid_export(&String::from_utf8_lossy(&output.stdout)))?
}

/// Parses `KEY=value` lines of `blkid -o export` into `(TYPE, UUID_SUB)`.
pub fn parse_blkid_export(text: &str) -> Option<(String, String)> {
    let value = |key: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
            .filter(|value| !value.is_empty())
            .map(str::to_string)
    };
    Some((value("TYPE")?, value("UUID_SUB")?))
}

fn probe_signatures(device: &Path) -> Result<Vec<Signature>, ProbeError> {
    let name = device.display().to_string();
    let output = Command::new("wipefs")
        .args([
            "--no-act",
            "--json",
            "--output",
            "TYPE,USAGE,UUID,LABEL,OFFSET",
        ])
        .arg(device)
        .output()
        .map_err(|source| ProbeError::Spawn {
            device: name.clone(),
            source,
        })?;
    if !output.status.success() {
        return Err(ProbeError::Failed {
            device: name,
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_string(),
        });
    }
    parse_wipefs(&output.stdout).map_err(|source| ProbeError::Parse {
        device: name,
        source,
    })
}

#[derive(Deserialize)]
struct WipefsOutput {
    #[serde(default)]
    signatures: Vec<WipefsSignature>,
}

#[derive(Deserialize)]
struct WipefsSignature {
    #[serde(rename = "type")]
    name: String,
    usage: Option<String>,
    uuid: Option<String>,
    label: Option<String>,
}

/// Parses `wipefs --json` output. A device without signatures prints nothing at all
/// on some util-linux versions and an empty list on others; both mean "clean".
/// Duplicates (GPT's backup header) collapse to one, and the protective MBR that
/// every GPT disk carries is folded into its `gpt`.
pub fn parse_wipefs(stdout: &[u8]) -> Result<Vec<Signature>, serde_json::Error> {
    if stdout.iter().all(u8::is_ascii_whitespace) {
        return Ok(Vec::new());
    }
    let output: WipefsOutput = serde_json::from_slice(stdout)?;
    let mut signatures: Vec<Signature> = Vec::new();
    for found in output.signatures {
        if signatures.iter().any(|known| known.name == found.name) {
            continue;
        }
        signatures.push(Signature {
            kind: kind_of(found.usage.as_deref()),
            name: found.name,
            uuid: found.uuid.filter(|uuid| !uuid.is_empty()),
            device_uuid: None,
            label: found.label.filter(|label| !label.is_empty()),
        });
    }
    if signatures.iter().any(|signature| signature.name == "gpt") {
        signatures.retain(|signature| signature.name != "PMBR");
    }
    Ok(signatures)
}

fn kind_of(usage: Option<&str>) -> SignatureKind {
    match usage {
        Some("partition-table") => SignatureKind::PartitionTable,
        Some("filesystem") => SignatureKind::Filesystem,
        Some("raid") => SignatureKind::Raid,
        Some("crypto") => SignatureKind::Crypto,
        _ => SignatureKind::Other,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // in tests a failed unwrap is a failed test
mod tests {
    use super::*;

    #[test]
    fn nothing_printed_or_an_empty_list_is_clean() {
        assert_eq!(parse_wipefs(b"").unwrap(), []);
        assert_eq!(parse_wipefs(b"  \n").unwrap(), []);
        assert_eq!(parse_wipefs(b"{\"signatures\": [\n\n]}").unwrap(), []);
    }

    #[test]
    fn gpt_collapses_its_backup_header_and_protective_mbr() {
        let out = br#"{"signatures": [
            {"type": "gpt", "usage": "partition-table", "uuid": null, "label": null, "offset": "0x200"},
            {"type": "gpt", "usage": "partition-table", "uuid": null, "label": null, "offset": "0x3fffe00"},
            {"type": "PMBR", "usage": "partition-table", "uuid": null, "label": null, "offset": "0x1fe"}]}"#;
        let signatures = parse_wipefs(out).unwrap();
        assert_eq!(
            signatures,
            [Signature {
                name: "gpt".into(),
                kind: SignatureKind::PartitionTable,
                uuid: None,
                device_uuid: None,
                label: None
            }]
        );
    }

    #[test]
    fn a_dos_table_keeps_its_name_and_usages_map_to_kinds() {
        let out = br#"{"signatures": [
            {"type": "dos", "usage": "partition-table", "offset": "0x1fe"},
            {"type": "ext4", "usage": "filesystem", "uuid": "u-1", "label": "", "offset": "0x438"},
            {"type": "linux_raid_member", "usage": "raid", "uuid": "r", "label": "host:0", "offset": "0x1000"},
            {"type": "crypto_LUKS", "usage": "crypto", "offset": "0x0"},
            {"type": "swap", "usage": "other", "offset": "0xff6"},
            {"type": "mystery", "offset": "0x0"}]}"#;
        let signatures = parse_wipefs(out).unwrap();
        let kinds: Vec<(&str, SignatureKind)> = signatures
            .iter()
            .map(|s| (s.name.as_str(), s.kind))
            .collect();
        assert_eq!(
            kinds,
            [
                ("dos", SignatureKind::PartitionTable),
                ("ext4", SignatureKind::Filesystem),
                ("linux_raid_member", SignatureKind::Raid),
                ("crypto_LUKS", SignatureKind::Crypto),
                ("swap", SignatureKind::Other),
                ("mystery", SignatureKind::Other),
            ]
        );
        assert_eq!(signatures[1].uuid.as_deref(), Some("u-1"));
        assert_eq!(signatures[1].label, None);
        assert_eq!(signatures[2].label.as_deref(), Some("host:0"));
    }

    #[test]
    fn blkid_export_gives_the_device_uuid() {
        let text = "DEVNAME=/dev/loop0\nLABEL=castellan-p1\nUUID=6a5b\nUUID_SUB=8cb7\nTYPE=btrfs\nUSAGE=filesystem\n";
        assert_eq!(
            parse_blkid_export(text),
            Some(("btrfs".into(), "8cb7".into()))
        );
        assert_eq!(parse_blkid_export("TYPE=ext4\nUUID=1\n"), None);
        assert_eq!(parse_blkid_export("UUID_SUB=1\n"), None);
        assert_eq!(parse_blkid_export("TYPE=btrfs\nUUID_SUB=\n"), None);
    }

    #[test]
    fn garbage_is_an_error() {
        assert!(parse_wipefs(b"not json").is_err());
    }

    #[test]
    fn a_missing_device_is_an_error_naming_it() {
        let error = probe(Path::new("/dev/castellan-no-such-device")).unwrap_err();
        assert!(
            error.to_string().contains("/dev/castellan-no-such-device"),
            "{error}"
        );
    }
}
