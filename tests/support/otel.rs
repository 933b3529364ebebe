//! A real OpenTelemetry Collector (deploy/otel/receiver.sh) that writes what it
//! receives over OTLP to a file, and the spans read back from it.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use super::repo;

/// The collector, stopped when dropped.
pub struct Receiver {
    dir: PathBuf,
}

impl Receiver {
    /// Starts one listening for OTLP/HTTP on `port` and OTLP/gRPC on `port + 1` of
    /// 127.0.0.1. Each test binary has its own pair, as they run side by side: 25400
    /// `tracing`, 25410 `agent_pools`. Below 32768, so that no outgoing connection's
    /// ephemeral port can hold one first (a CI run failed on 47400 that way).
    pub fn start(port: u16) -> Self {
        let dir = std::env::temp_dir().join(format!("otel-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("receiver directory");
        let status = Command::new(repo().join("deploy/otel/receiver.sh"))
            .arg("start")
            .arg(&dir)
            .arg(port.to_string())
            .status()
            .expect("running deploy/otel/receiver.sh");
        assert!(status.success(), "the OTLP receiver did not start");
        Self { dir }
    }

    /// The file the collector writes the spans it received to.
    pub fn traces(&self) -> PathBuf {
        self.dir.join("traces.jsonl")
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = Command::new(repo().join("deploy/otel/receiver.sh"))
            .arg("stop")
            .arg(&self.dir)
            .status();
    }
}

#[derive(Debug, Clone)]
pub struct Span {
    pub service: String,
    pub name: String,
    pub trace: String,
    pub id: String,
    pub parent: String,
    /// When it started, in nanoseconds since the Unix epoch.
    pub start: u64,
    /// Its string, integer and boolean attributes, as text.
    pub attributes: std::collections::BTreeMap<String, String>,
}

/// Every span in the collector's file (OTLP JSON, one export request per line).
pub fn spans(file: &Path) -> Vec<Span> {
    let text = std::fs::read_to_string(file).unwrap_or_default();
    let mut found = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(request) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        for resource in request["resourceSpans"].as_array().into_iter().flatten() {
            let service = resource["resource"]["attributes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|a| a["key"] == "service.name")
                .and_then(|a| a["value"]["stringValue"].as_str())
                .unwrap_or_default()
                .to_owned();
            for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                for span in scope["spans"].as_array().into_iter().flatten() {
                    let text = |key: &str| span[key].as_str().unwrap_or_default().to_owned();
                    let attributes = span["attributes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|a| {
                            let value = &a["value"];
                            let value = value["stringValue"]
                                .as_str()
                                .map(str::to_owned)
                                .or_else(|| value["intValue"].as_str().map(str::to_owned))
                                .or_else(|| value["boolValue"].as_bool().map(|b| b.to_string()))?;
                            Some((a["key"].as_str()?.to_owned(), value))
                        })
                        .collect();
                    found.push(Span {
                        service: service.clone(),
                        name: text("name"),
                        trace: text("traceId"),
                        id: text("spanId"),
                        parent: text("parentSpanId"),
                        // OTLP JSON writes 64-bit integers as strings.
                        start: text("startTimeUnixNano").parse().unwrap_or_default(),
                        attributes,
                    });
                }
            }
        }
    }
    found
}
