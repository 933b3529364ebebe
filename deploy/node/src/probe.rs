//! Startup, readiness and liveness probes with the kubelet's semantics: `httpGet`
//! (2xx/3xx is success), `tcpSocket` (a connection is success) and `exec` (exit 0 is
//! success, run in the container's sandbox), each with its delay, period, timeout and
//! thresholds. HTTPS and gRPC probes are not supported and always fail, with a message.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::container::{Launch, sandbox_command};

/// Where probes of one container connect and what exec probes run as.
#[derive(Clone)]
pub struct ProbeTarget {
    pub pod_ip: String,
    pub container: Container,
    pub launch: Launch,
}

/// What the probes of a running container found out.
#[derive(Debug, PartialEq)]
pub enum ProbeEvent {
    /// The startup probe succeeded (sent at once when there is none).
    Started,
    Ready(bool),
    /// The container must be restarted: why.
    Kill(String),
}

struct Timing {
    initial_delay: Duration,
    period: Duration,
    timeout: Duration,
    success_threshold: u32,
    failure_threshold: u32,
}

fn timing(probe: &Probe) -> Timing {
    let seconds = |value: Option<i32>, default: u64| {
        Duration::from_secs(value.and_then(|v| u64::try_from(v).ok()).unwrap_or(default))
    };
    let count = |value: Option<i32>, default: u32| {
        value
            .and_then(|v| u32::try_from(v).ok())
            .filter(|v| *v > 0)
            .unwrap_or(default)
    };
    Timing {
        initial_delay: seconds(probe.initial_delay_seconds, 0),
        period: seconds(probe.period_seconds, 10).max(Duration::from_secs(1)),
        timeout: seconds(probe.timeout_seconds, 1).max(Duration::from_secs(1)),
        success_threshold: count(probe.success_threshold, 1),
        failure_threshold: count(probe.failure_threshold, 3),
    }
}

/// Runs the container's probes for one run of it, reporting to `events`, until the
/// receiver goes away (the caller aborts this task when the run ends).
pub async fn watch(target: ProbeTarget, events: mpsc::Sender<ProbeEvent>) {
    let container = &target.container;
    if let Some(startup) = &container.startup_probe {
        let timing = timing(startup);
        tokio::time::sleep(timing.initial_delay).await;
        let mut failures = 0;
        loop {
            match check(startup, &target, timing.timeout).await {
                Ok(()) => break,
                Err(reason) => {
                    failures += 1;
                    if failures >= timing.failure_threshold {
                        let _ = events
                            .send(ProbeEvent::Kill(format!("Startup probe failed: {reason}")))
                            .await;
                        return;
                    }
                }
            }
            tokio::time::sleep(timing.period).await;
        }
    }
    if events.send(ProbeEvent::Started).await.is_err() {
        return;
    }
    let readiness = readiness_loop(&target, &events);
    let liveness = liveness_loop(&target, &events);
    tokio::join!(readiness, liveness);
}

async fn readiness_loop(target: &ProbeTarget, events: &mpsc::Sender<ProbeEvent>) {
    let Some(probe) = &target.container.readiness_probe else {
        let _ = events.send(ProbeEvent::Ready(true)).await;
        return;
    };
    let timing = timing(probe);
    tokio::time::sleep(timing.initial_delay).await;
    let (mut successes, mut failures, mut ready) = (0, 0, false);
    loop {
        match check(probe, target, timing.timeout).await {
            Ok(()) => {
                successes += 1;
                failures = 0;
                if !ready && successes >= timing.success_threshold {
                    ready = true;
                    if events.send(ProbeEvent::Ready(true)).await.is_err() {
                        return;
                    }
                }
            }
            Err(reason) => {
                failures += 1;
                successes = 0;
                tracing::debug!(
                    container = target.container.name,
                    "readiness probe failed: {reason}"
                );
                if ready && failures >= timing.failure_threshold {
                    ready = false;
                    if events.send(ProbeEvent::Ready(false)).await.is_err() {
                        return;
                    }
                }
            }
        }
        tokio::time::sleep(timing.period).await;
    }
}

async fn liveness_loop(target: &ProbeTarget, events: &mpsc::Sender<ProbeEvent>) {
    let Some(probe) = &target.container.liveness_probe else {
        return;
    };
    let timing = timing(probe);
    tokio::time::sleep(timing.initial_delay).await;
    let mut failures = 0;
    loop {
        match check(probe, target, timing.timeout).await {
            Ok(()) => failures = 0,
            Err(reason) => {
                failures += 1;
                if failures >= timing.failure_threshold {
                    let _ = events
                        .send(ProbeEvent::Kill(format!("Liveness probe failed: {reason}")))
                        .await;
                    return;
                }
            }
        }
        tokio::time::sleep(timing.period).await;
    }
}

/// One attempt of a probe.
pub async fn check(probe: &Probe, target: &ProbeTarget, timeout: Duration) -> Result<(), String> {
    match tokio::time::timeout(timeout, attempt(probe, target)).await {
        Ok(result) => result,
        Err(_elapsed) => Err(format!("timed out after {timeout:?}")),
    }
}

async fn attempt(probe: &Probe, target: &ProbeTarget) -> Result<(), String> {
    if let Some(http) = &probe.http_get {
        if http
            .scheme
            .as_deref()
            .is_some_and(|scheme| scheme.eq_ignore_ascii_case("HTTPS"))
        {
            return Err("HTTPS probes are not supported by castellan-devnode".to_string());
        }
        let host = http
            .host
            .clone()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| target.pod_ip.clone());
        let port = resolve_port(&http.port, &target.container)?;
        let path = http
            .path
            .clone()
            .filter(|p| !p.is_empty())
            .unwrap_or_else(|| "/".to_string());
        let headers: Vec<(String, String)> = http
            .http_headers
            .iter()
            .flatten()
            .map(|header| (header.name.clone(), header.value.clone()))
            .collect();
        return http_get(&host, port, &path, &headers).await;
    }
    if let Some(tcp) = &probe.tcp_socket {
        let host = tcp
            .host
            .clone()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| target.pod_ip.clone());
        let port = resolve_port(&tcp.port, &target.container)?;
        return TcpStream::connect((host.as_str(), port))
            .await
            .map(drop)
            .map_err(|error| format!("dial tcp {host}:{port}: {error}"));
    }
    if let Some(exec) = &probe.exec {
        let mut launch = target.launch.clone();
        launch.argv = exec.command.clone().unwrap_or_default();
        let mut command = sandbox_command(&launch);
        command
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let output = command
            .output()
            .await
            .map_err(|error| format!("running {:?}: {error}", launch.argv))?;
        return if output.status.success() {
            Ok(())
        } else {
            Err(format!(
                "command {:?} exited with {}: {}",
                launch.argv,
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ))
        };
    }
    Err(
        "probe has no handler supported by castellan-devnode (httpGet, tcpSocket, exec)"
            .to_string(),
    )
}

/// A probe's port: a number, or the name of one of the container's ports.
fn resolve_port(port: &IntOrString, container: &Container) -> Result<u16, String> {
    match port {
        IntOrString::Int(number) => {
            u16::try_from(*number).map_err(|_| format!("invalid port {number}"))
        }
        IntOrString::String(name) => container
            .ports
            .iter()
            .flatten()
            .find(|port| port.name.as_deref() == Some(name.as_str()))
            .and_then(|port| u16::try_from(port.container_port).ok())
            .ok_or_else(|| format!("container has no port named {name:?}")),
    }
}

/// A minimal HTTP/1.1 GET: enough for a probe, which only reads the status line.
async fn http_get(
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
) -> Result<(), String> {
    let mut stream = TcpStream::connect((host, port))
        .await
        .map_err(|error| format!("Get \"http://{host}:{port}{path}\": {error}"))?;
    let mut request = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe/1.37\r\nAccept: */*\r\nConnection: close\r\n"
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|error| format!("sending probe: {error}"))?;
    let mut head = Vec::new();
    let mut buffer = [0u8; 512];
    while !head.windows(2).any(|pair| pair == b"\r\n") && head.len() < 4096 {
        let read = stream
            .read(&mut buffer)
            .await
            .map_err(|error| format!("reading probe response: {error}"))?;
        if read == 0 {
            break;
        }
        head.extend_from_slice(&buffer[..read]);
    }
    let status = status_code(&head).ok_or_else(|| "malformed HTTP response".to_string())?;
    if (200..400).contains(&status) {
        Ok(())
    } else {
        Err(format!("HTTP probe failed with statuscode: {status}"))
    }
}

fn status_code(head: &[u8]) -> Option<u16> {
    let line = head.split(|byte| *byte == b'\n').next()?;
    let line = std::str::from_utf8(line).ok()?;
    let mut parts = line.split_whitespace();
    parts
        .next()
        .filter(|version| version.starts_with("HTTP/"))?;
    parts.next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ContainerPort;

    #[test]
    fn parses_status_lines() {
        assert_eq!(status_code(b"HTTP/1.0 200 OK\r\n"), Some(200));
        assert_eq!(
            status_code(b"HTTP/1.1 503 Service Unavailable\r\nX: y"),
            Some(503)
        );
        assert_eq!(status_code(b"garbage"), None);
    }

    #[test]
    fn named_ports_resolve_from_the_container() {
        let container = Container {
            ports: Some(vec![ContainerPort {
                name: Some("http".into()),
                container_port: 8080,
                ..ContainerPort::default()
            }]),
            ..Container::default()
        };
        assert_eq!(
            resolve_port(&IntOrString::String("http".into()), &container),
            Ok(8080)
        );
        assert!(resolve_port(&IntOrString::String("db".into()), &container).is_err());
        assert_eq!(resolve_port(&IntOrString::Int(80), &container), Ok(80));
    }
}
