//! The control socket protocol: one JSON request per line, one JSON reply per line.
//!
//! Requests are [`Request`] (`{"op":"status"}`, `{"op":"snapshot","path":"/dir","diff":false}`,
//! ...). A reply is `{"ok":true, ...fields of the op's reply type}` or
//! `{"ok":false,"error":"what to fix"}`; [`encode_reply`] and [`decode_reply`] are the two
//! ends of that envelope.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::config::NetConfig;

/// Longest request line a VMM reads; anything longer is refused.
pub const MAX_REQUEST: u64 = 64 * 1024;
/// Longest reply line a client reads (a balloon reply with every statistic is ~1 KiB).
pub const MAX_REPLY: u64 = 1024 * 1024;

/// One request on the control socket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Answered by [`StatusReply`].
    Status,
    /// Pauses vCPUs and devices; answered by [`Done`].
    Pause,
    /// Answered by [`Done`].
    Resume,
    /// Writes a snapshot into the new directory `path` (a running VM is paused meanwhile and
    /// resumed after); answered by [`SnapshotReply`].
    Snapshot {
        path: PathBuf,
        /// Only the pages written since this VM's previous snapshot.
        #[serde(default)]
        diff: bool,
        /// Only the pages that differ from the full snapshot this VM's memory maps (a VM
        /// restored MAP_PRIVATE, from that snapshot or a diff chain on it): `base` is recorded
        /// as the new snapshot's parent, relative to its directory when relative, and must
        /// name a copy of that full snapshot when it is restored. Excludes `diff`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        base: Option<PathBuf>,
    },
    /// Ends the VM (answered with [`Done`] first).
    Stop,
    /// Sets the balloon target if given, and reports; answered by [`BalloonReply`].
    Balloon {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target_mib: Option<u64>,
    },
    /// For a `--prewarm` VMM only, and only as its first request; answered by
    /// [`RestoreReply`].
    Restore(RestoreRequest),
}

impl Request {
    /// The op's name on the wire.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Status => "status",
            Request::Pause => "pause",
            Request::Resume => "resume",
            Request::Snapshot { .. } => "snapshot",
            Request::Stop => "stop",
            Request::Balloon { .. } => "balloon",
            Request::Restore(_) => "restore",
        }
    }
}

/// What a prewarmed VMM is asked to restore; its fields override the launch's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreRequest {
    pub path: PathBuf,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_uds: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock_cid: Option<u64>,
    /// The snapshot's network device goes on this tap (with this MAC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<NetConfig>,
    #[serde(default)]
    pub lazy: bool,
    #[serde(default)]
    pub prefetch: bool,
}

/// The reply of an op that only succeeds or fails (`pause`, `resume`, `stop`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Done {}

/// Whether the vCPUs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Running,
    Paused,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReply {
    pub state: RunState,
    pub vcpus: u8,
    pub mem_mib: u64,
    /// Pages a lazily restored VM has faulted in (None: not restored lazily).
    pub lazy_faults: Option<u64>,
    /// Pages of the working set loaded in the background.
    pub lazy_prefetched: Option<u64>,
    /// KVM's own counters summed over the vCPUs (`exits`, `pf_taken`, `halt_exits`, ...):
    /// the exits KVM handles itself never reach the VMM. Empty on hosts without
    /// `KVM_GET_STATS_FD` (before Linux 5.14).
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub kvm_vcpu_stats: std::collections::BTreeMap<String, u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SnapshotReply {
    pub pages_written: u64,
    pub diff: bool,
    /// How long the vCPUs stood still for it. A running VM is paused only while its vCPU
    /// and device state are read; its memory is written while the guest runs again.
    pub paused_ms: f64,
    /// Request -> snapshot complete (memory written, directory committed); the reply comes
    /// only then.
    #[serde(default)]
    pub complete_ms: f64,
    /// How guest memory was written.
    #[serde(default)]
    pub memory_mode: SnapshotMemoryMode,
    /// Where the pause went, step by step.
    #[serde(default)]
    pub pause_steps: PauseSteps,
    /// Pre-copy: pages written per round while the guest ran (the first round is every
    /// non-zero page); empty otherwise.
    #[serde(default)]
    pub precopy_rounds: Vec<u64>,
    /// Pages written for the pause instant (pre-copy's last dirty set, a diff's pages, or
    /// every non-zero page of a full snapshot written with the guest paused or forked).
    #[serde(default)]
    pub final_pages: u64,
}

/// How a snapshot's memory was written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotMemoryMode {
    /// All of it with the guest paused (a paused VM, a lazily restored VM, a failed fork).
    #[default]
    Paused,
    /// By a forked child holding a copy-on-write view of memory while the guest ran on.
    CopyOnWrite,
    /// Written while the guest ran, then the last dirty pages with the guest paused.
    Precopy,
    /// Pre-copy whose last dirty set stayed large: that set went through a forked child.
    PrecopyCopyOnWrite,
}

/// Milliseconds spent in each step of a snapshot's pause (0: the step did not happen inside
/// the pause). Their sum is close to `paused_ms`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PauseSteps {
    /// vCPUs kicked out of KVM_RUN and parked, device threads stopped.
    pub pause_ms: f64,
    /// Snapshot directory and memory file created.
    pub create_ms: f64,
    /// vCPU, interrupt controller, PIT, clock and device state read.
    pub state_ms: f64,
    /// Memory writer prepared: file sized, dirty logs read (and reset).
    pub prepare_ms: f64,
    /// KVM's dirty log registered or cleared for the next diff.
    pub dirty_log_ms: f64,
    /// Memory written with the guest paused.
    pub write_ms: f64,
    /// The copy-on-write fork of the VMM.
    pub fork_ms: f64,
    /// Device threads and vCPUs resumed.
    pub resume_ms: f64,
}

/// The balloon's target, actual size, the guest's statistics and the device's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BalloonReply {
    pub target_mib: u64,
    pub target_pages: u32,
    pub actual_mib: u64,
    pub actual_pages: u32,
    /// The guest's last statistics by Linux's names (`free_memory`, ...; unknown tags as
    /// `tag_N`).
    pub stats: BTreeMap<String, u64>,
    /// How long ago they arrived (None: never).
    pub stats_age_ms: Option<u64>,
    pub inflated_pages: u64,
    pub deflated_pages: u64,
    pub reported_bytes: u64,
    /// Page frames or ranges outside guest RAM (skipped).
    pub bad_pfns: u64,
    /// Chains that could not be read at all (returned unused).
    pub bad_chains: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RestoreReply {
    /// Request -> VM restored, inside the VMM.
    pub restore_ms: f64,
    /// Where that went, step by step.
    #[serde(default)]
    pub steps: RestoreSteps,
}

/// Milliseconds spent in each step of a restore. Their sum is close to `restore_ms`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RestoreSteps {
    /// The snapshot's state file read and decoded.
    pub state_ms: f64,
    /// Guest memory mapped from the snapshot (and diffs applied), KVM memory slots set.
    pub memory_ms: f64,
    /// Interrupt controllers and the guest clock restored.
    pub irqchip_clock_ms: f64,
    /// Devices rebuilt from their saved state (disks and sockets opened).
    pub devices_ms: f64,
    /// vCPU state loaded and vCPU threads started.
    pub vcpus_ms: f64,
    /// Pending interrupts raised again and the PIT restored.
    pub finish_ms: f64,
}

/// Why a reply line could not be read as the expected reply.
#[derive(Debug, thiserror::Error)]
pub enum ReplyError {
    #[error("the VMM refused: {0}")]
    Refused(String),
    #[error("the VMM's reply {line:?} is not what this client expects ({source}); are dsec-vmm and this program from the same build?")]
    Malformed {
        line: String,
        source: serde_json::Error,
    },
}

#[derive(Serialize)]
struct Success<'a, T> {
    ok: bool,
    #[serde(flatten)]
    body: &'a T,
}

#[derive(Serialize, Deserialize)]
struct Failure {
    ok: bool,
    #[serde(default)]
    error: Option<String>,
}

/// One reply line (with its newline): `{"ok":true,...body}` or `{"ok":false,"error":...}`.
pub fn encode_reply<T: Serialize>(result: Result<&T, &str>) -> Vec<u8> {
    let encoded = match result {
        Ok(body) => serde_json::to_vec(&Success { ok: true, body }),
        Err(message) => serde_json::to_vec(&Failure {
            ok: false,
            error: Some(message.to_string()),
        }),
    };
    // Both shapes are plain structs of strings and numbers; serialising them cannot fail,
    // but a reply must go out in any case.
    let mut line = encoded
        .unwrap_or_else(|_| br#"{"ok":false,"error":"reply could not be encoded"}"#.to_vec());
    line.push(b'\n');
    line
}

/// Reads one reply line as `T` (or the VMM's refusal).
pub fn decode_reply<T: DeserializeOwned>(line: &str) -> Result<T, ReplyError> {
    let malformed = |source| ReplyError::Malformed {
        line: line.trim().to_string(),
        source,
    };
    let head: Failure = serde_json::from_str(line).map_err(malformed)?;
    if !head.ok {
        return Err(ReplyError::Refused(
            head.error.unwrap_or_else(|| "no reason given".into()),
        ));
    }
    serde_json::from_str(line).map_err(malformed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_keep_their_wire_form() {
        let cases = [
            (Request::Status, r#"{"op":"status"}"#),
            (Request::Stop, r#"{"op":"stop"}"#),
            (
                Request::Snapshot {
                    path: "/s".into(),
                    diff: true,
                    base: None,
                },
                r#"{"op":"snapshot","path":"/s","diff":true}"#,
            ),
            (
                Request::Snapshot {
                    path: "/s".into(),
                    diff: false,
                    base: Some("base".into()),
                },
                r#"{"op":"snapshot","path":"/s","diff":false,"base":"base"}"#,
            ),
            (Request::Balloon { target_mib: None }, r#"{"op":"balloon"}"#),
            (
                Request::Balloon {
                    target_mib: Some(64),
                },
                r#"{"op":"balloon","target_mib":64}"#,
            ),
            (
                Request::Restore(RestoreRequest {
                    path: "/s".into(),
                    vsock_uds: Some("/v".into()),
                    lazy: true,
                    ..Default::default()
                }),
                r#"{"op":"restore","path":"/s","vsock_uds":"/v","lazy":true,"prefetch":false}"#,
            ),
        ];
        for (request, wire) in cases {
            assert_eq!(serde_json::to_string(&request).unwrap(), wire);
            assert_eq!(serde_json::from_str::<Request>(wire).unwrap(), request);
        }
        // Older clients leave defaults out.
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"snapshot","path":"/s"}"#).unwrap(),
            Request::Snapshot {
                path: "/s".into(),
                diff: false,
                base: None,
            }
        );
        let net: Request =
            serde_json::from_str(r#"{"op":"restore","path":"/s","net":{"tap":"t0"}}"#).unwrap();
        assert!(matches!(net, Request::Restore(r) if r.net.as_ref().unwrap().tap == "t0"));
    }

    #[test]
    fn unknown_fields_and_ops_are_refused() {
        for bad in [
            r#"{"op":"snapshot","path":"/s","dif":true}"#,
            r#"{"op":"restore","path":"/s","lazyy":true}"#,
            r#"{"op":"reboot"}"#,
            r#"{"path":"/s"}"#,
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn replies_round_trip_through_the_envelope() {
        let status = StatusReply {
            state: RunState::Paused,
            vcpus: 2,
            mem_mib: 256,
            lazy_faults: Some(10),
            lazy_prefetched: None,
            kvm_vcpu_stats: [("pf_taken".to_string(), 1900)].into(),
        };
        let line = encode_reply(Ok(&status));
        let text = std::str::from_utf8(&line).unwrap();
        assert!(text.starts_with(r#"{"ok":true,"state":"paused""#), "{text}");
        assert!(text.ends_with('\n'));
        assert_eq!(decode_reply::<StatusReply>(text).unwrap(), status);
        let done = encode_reply(Ok(&Done {}));
        assert_eq!(done, b"{\"ok\":true}\n");
        decode_reply::<Done>(std::str::from_utf8(&done).unwrap()).unwrap();
        let mut balloon = BalloonReply {
            target_mib: 64,
            ..Default::default()
        };
        balloon.stats.insert("free_memory".into(), 1 << 20);
        let line = encode_reply(Ok(&balloon));
        let back: BalloonReply = decode_reply(std::str::from_utf8(&line).unwrap()).unwrap();
        assert_eq!(back, balloon);
    }

    #[test]
    fn refusals_and_garbage_are_typed() {
        let line = encode_reply::<Done>(Err("no balloon; start it with --balloon"));
        let err = decode_reply::<BalloonReply>(std::str::from_utf8(&line).unwrap()).unwrap_err();
        assert!(
            matches!(&err, ReplyError::Refused(m) if m.contains("--balloon")),
            "{err}"
        );
        let err = decode_reply::<SnapshotReply>(r#"{"ok":true}"#).unwrap_err();
        assert!(matches!(err, ReplyError::Malformed { .. }), "{err}");
        let err = decode_reply::<Done>("not json").unwrap_err();
        assert!(err.to_string().contains("same build"), "{err}");
    }
}
