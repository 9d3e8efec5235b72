//! dsec-perf: DSec's benchmark harness. `dsec-perf boot` measures boot latency of our VMM
//! beside QEMU `-M microvm`, alternating between them, and reports percentiles and ratios;
//! `dsec-perf snapshot` measures restore, fork and the memory of forked children;
//! `dsec-perf layerfs` measures the layerfs image path (cold start, warm reads);
//! `dsec-perf node` measures the node daemon (create, bursts of creates, exec round trip).

mod cluster;
mod debian;
mod direct;
mod fleet;
mod fncall;
mod fncall_vm;
mod guest;
mod kvmfloor;
mod layerfs;
mod live_snapshot;
mod machine;
mod net;
mod node;
mod report;
mod rig;
mod rig_devices;
mod rig_snapshot;
mod run;
mod snapshot;
mod stage;
mod stats;
mod templates;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(name = "dsec-perf", version, about = "DSec benchmark harness")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Boot latency: our VMM vs QEMU microvm, directly (test guest) and in the rig (Linux).
    Boot(BootArgs),
    /// Snapshot restore latency (MAP_PRIVATE, lazy, lazy + prefetch) vs a cold boot, fork
    /// latency for batches of children, host memory of forked children vs independent VMs.
    Snapshot(SnapArgs),
    /// layerfs on a ~1 GiB Debian image (debootstrap, cached; else staged from this host's
    /// files): empty node cache to the first command (lazy FUSE mount vs fetch-all +
    /// extract), warm re-reads vs native ext4. Needs root and /dev/fuse.
    Layerfs(LayerfsArgs),
    /// Device throughput and VMM memory, ours vs QEMU microvm, in the rig (Linux guest):
    /// block sequential/random reads, TCP both ways, idle VMM memory overhead.
    Devices(DevicesArgs),
    /// The node daemon: a real dsec-edge on a private state dir, driven through the Rust
    /// SDK: create -> first exec beside unshare/bwrap, bursts of concurrent creates, exec
    /// round trip in a warm sandbox. Needs root.
    Node(NodeArgs),
    /// Sandbox networking (containers): create latency with and without a sandbox
    /// network and its setup time, setup time with sandboxes held, TCP throughput and
    /// connection rate through a policy of 1 rule vs 1,000, live policy changes alone and
    /// under concurrent creates. Needs root, ip, nft.
    Net(NetArgs),
    /// FnCall (one-shot code execution): python print(1+1), a numpy snippet and a C++ hello
    /// world through our HTTP (SandboxFusion) and gRPC APIs, beside python3/g++ in bwrap
    /// per call and `dsec run` per call: p50/p99 latency, calls/s at concurrency 1, 16, 64.
    /// Needs root and the fncall image.
    Fncall(FncallArgs),
    /// The VMM FnCall mode through a running node: a python call in a microVM restored per
    /// call beside a container worker's call, `dsec run` and a cold microVM, p50 of a few
    /// samples. Needs a node with hardware KVM (the rig's L1: tests/rig/tests/fncall-vm.sh).
    FncallVm(FncallVmArgs),
    /// microVM creates through a running node as an SDK user sees them: create -> first
    /// exec from the image's template beside a cold boot, and pause -> resume -> first exec,
    /// one client, contenders alternating. Needs a node with hardware KVM (the rig's L1:
    /// tests/rig/tests/node-templates.sh).
    Templates(TemplatesArgs),
    /// The control plane: placement throughput through real apiservers (1 and 2 replicas)
    /// and a real etcd over simulated nodes (`dsec control sim-nodes`), and what the
    /// apiserver adds to a real create -> first exec. Needs root for the real node.
    Cluster(ClusterArgs),
    /// (Used inside the rig's L1.) Boot the Linux guest with each VMM in --order and print
    /// one PERF-RIG line per boot.
    #[command(hide = true)]
    RigInner(RigInnerArgs),
}

#[derive(Args, Debug)]
struct NetArgs {
    /// Creates per contender in the setup and growth scenarios.
    #[arg(long, default_value_t = 30)]
    samples: usize,
    /// Levels of sandboxes held on the node in the growth scenario.
    #[arg(long, value_delimiter = ',', default_value = "0,100,200")]
    held: Vec<usize>,
    /// Rules of the large policy.
    #[arg(long, default_value_t = 1000)]
    rules: usize,
    /// MiB sent per throughput sample.
    #[arg(long, default_value_t = 256)]
    transfer_mib: usize,
    /// Connections per connection-rate sample.
    #[arg(long, default_value_t = 200)]
    connections: usize,
    /// Samples per policy in the policy scenario.
    #[arg(long, default_value_t = 5)]
    policy_samples: usize,
    /// Live policy changes per contender (idle, under creates); 0 skips the scenario.
    #[arg(long, default_value_t = 20)]
    live_samples: usize,
    /// Concurrent create+delete loops while the loaded live changes run.
    #[arg(long, default_value_t = 2)]
    live_load: usize,
    /// An extra flag for the networked daemon (repeatable), e.g. `--edge-arg=--net-veth-pool
    /// --edge-arg=0` to measure creates without the pool of prepared namespaces.
    #[arg(long = "edge-arg", value_name = "ARG", allow_hyphen_values = true)]
    edge_args: Vec<String>,
    /// dsec-edge [default: next to this binary, else target/release].
    #[arg(long, value_name = "PATH")]
    edge: Option<PathBuf>,
    /// Write the results here as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct TemplatesArgs {
    /// The node [default: $DSEC_ENDPOINT, else the SDK's default socket].
    #[arg(long)]
    endpoint: Option<String>,
    /// Samples per contender (template, cold, resume; alternating).
    #[arg(long, default_value_t = 5)]
    samples: usize,
    /// Guest memory of every sandbox, MiB.
    #[arg(long, default_value_t = 128)]
    memory_mib: i64,
    /// Write the results here as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct FncallVmArgs {
    /// The node [default: $DSEC_ENDPOINT, else the SDK's default socket].
    #[arg(long)]
    endpoint: Option<String>,
    /// Samples of the VM and container contenders (alternating).
    #[arg(long, default_value_t = 5)]
    samples: usize,
    /// Samples of `dsec run` and of the cold microVM (create --cold, exec, rm).
    #[arg(long, default_value_t = 3)]
    cold_samples: usize,
    /// The VM FnCall image.
    #[arg(long, default_value = "fncall-vm")]
    vm_image: String,
    /// The container FnCall image.
    #[arg(long, default_value = "fncall")]
    container_image: String,
    /// The dsec binary [default: next to this binary, else target/release].
    #[arg(long, value_name = "PATH")]
    dsec: Option<PathBuf>,
    /// Write the results here as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct FncallArgs {
    /// Latency samples per contender (contenders alternate call by call).
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Latency samples of the `dsec run` contender (a cold sandbox each); 0 skips it.
    #[arg(long, default_value_t = 10)]
    run_samples: usize,
    /// Concurrencies of the throughput rounds.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    concurrency: Vec<usize>,
    /// Throughput rounds per contender and concurrency.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Multiplies the calls of each throughput round (print: 400 each), for longer
    /// sustained rounds.
    #[arg(long, default_value_t = 1)]
    round_scale: usize,
    /// Python workers kept warm by the engine.
    #[arg(long, default_value_t = 8)]
    python_workers: usize,
    /// Snippets to run (print, print-full, numpy, cpp) [default: all].
    #[arg(long, value_delimiter = ',')]
    snippets: Vec<String>,
    /// Image directory [default: $DSEC_HOME/images].
    #[arg(long, value_name = "DIR")]
    images: Option<PathBuf>,
    /// The FnCall image.
    #[arg(long, default_value = "fncall")]
    image: String,
    /// The dsec binary for the `dsec run` contender [default: next to this binary, else
    /// target/release].
    #[arg(long, value_name = "PATH")]
    dsec: Option<PathBuf>,
    /// Write the full results (machine info, summaries, ratios, every sample) here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct BootArgs {
    /// Samples per contender in the direct scenario (contenders alternate every sample).
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// Discarded warm-up runs per contender before the direct samples (page cache, etc.).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Write the full results (machine info, summaries, ratios, every sample) here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Our VMM binary [default: dsec-vmm next to this binary, else target/release, else PATH].
    #[arg(long, value_name = "PATH")]
    vmm: Option<PathBuf>,
    /// QEMU binary.
    #[arg(long, value_name = "PATH", default_value = "qemu-system-x86_64")]
    qemu: PathBuf,
    /// Test guest ELF for the direct scenario [default: the `serial` guest from
    /// vmm/test-guests, built by cargo into target/test-guests].
    #[arg(long, value_name = "PATH")]
    guest: Option<PathBuf>,
    /// Console line the test guest prints when done.
    #[arg(long, default_value = "DONE 0 0")]
    done_marker: String,
    /// QEMU accelerators to run in the direct scenario, each a contender.
    #[arg(long, value_delimiter = ',', default_value = "kvm,tcg")]
    qemu_accel: Vec<String>,
    /// Guest memory in the direct scenario (both VMMs).
    #[arg(long, default_value_t = 128)]
    mem_mib: u32,
    /// Per-run timeout in the direct scenario.
    #[arg(long, default_value_t = 30)]
    timeout_s: u64,
    /// Skip the direct scenario.
    #[arg(long)]
    skip_direct: bool,
    /// Samples per contender in the rig (Linux guest to agent-ready); 0 skips the rig.
    /// Each sample boots one fresh L1 per contender (about 20-40 s each).
    #[arg(long, default_value_t = 5)]
    rig_samples: usize,
    /// Run all rig boots in one L1, strictly alternating, instead of a fresh L1 per boot
    /// (faster; later VMs in one L1 are slower, so only the alternation keeps it fair).
    #[arg(long)]
    rig_shared_l1: bool,
    /// The rig driver [default: tests/rig/rig.sh in the repo].
    #[arg(long, value_name = "PATH")]
    rig: Option<PathBuf>,
    /// Guest kernel (PVH vmlinux) [default: guest-kernel/build.sh's cached build].
    #[arg(long, value_name = "PATH")]
    guest_kernel: Option<PathBuf>,
    /// Agent initramfs [default: $DSEC_HOME/images/busybox/initramfs.cpio or
    /// target/images/busybox/initramfs.cpio].
    #[arg(long, value_name = "PATH")]
    guest_initramfs: Option<PathBuf>,
    /// Guest memory in the rig (both VMMs).
    #[arg(long, default_value_t = 256)]
    rig_mem_mib: u32,
    /// Per-boot timeout inside L1.
    #[arg(long, default_value_t = 120)]
    rig_boot_timeout_s: u64,
    /// Appended to the guest kernel cmdline of both VMMs in the rig (experiments, e.g.
    /// "i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd").
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    rig_cmdline_extra: String,
    /// Samples per contender of the rig scenario on the Debian root disk (read-only erofs
    /// root + fresh ext4 upper; the agent is ready once it has entered the overlay);
    /// 0 skips it. Fresh L1 per boot unless --rig-shared-l1.
    #[arg(long, default_value_t = 3)]
    rig_disk_samples: usize,
    /// Root disk image of that scenario [default: $DSEC_HOME/images/debian/rootfs.img].
    #[arg(long, value_name = "PATH")]
    root_disk: Option<PathBuf>,
    /// A Firecracker binary: a third contender in the rig scenarios (`--no-api
    /// --config-file`, the same kernel, initramfs, cmdline, memory, 1 vCPU, a vsock device).
    #[arg(long, value_name = "PATH")]
    firecracker: Option<PathBuf>,
    /// Keep the scratch directory (stderr of every contender, rig logs and consoles).
    #[arg(long)]
    keep_workdir: bool,
}

#[derive(Args, Debug)]
struct DevicesArgs {
    /// Rounds; each boots both VMMs idle and with devices, alternating which goes first.
    #[arg(long, default_value_t = 3)]
    samples: usize,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u32,
    /// Size of the raw disk image the guest reads.
    #[arg(long, default_value_t = 64)]
    disk_mib: u32,
    /// Random 4 KiB reads per sample.
    #[arg(long, default_value_t = 2000)]
    rand_reads: u32,
    /// MiB sent each way over TCP per sample.
    #[arg(long, default_value_t = 16)]
    tcp_mib: u32,
    /// Write the full results here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Our VMM binary [default: dsec-vmm next to this binary, else target/release, else PATH].
    #[arg(long, value_name = "PATH")]
    vmm: Option<PathBuf>,
    /// Static dsec-guest-bench [default: target/x86_64-unknown-linux-gnu/release/, built by
    /// setup.sh].
    #[arg(long, value_name = "PATH")]
    guest_bench: Option<PathBuf>,
    /// The rig driver [default: tests/rig/rig.sh in the repo].
    #[arg(long, value_name = "PATH")]
    rig: Option<PathBuf>,
    /// Guest kernel [default: guest-kernel/build.sh's cached build].
    #[arg(long, value_name = "PATH")]
    guest_kernel: Option<PathBuf>,
    /// Agent initramfs the benchmark init is appended to [default:
    /// $DSEC_HOME/images/busybox/initramfs.cpio].
    #[arg(long, value_name = "PATH")]
    guest_initramfs: Option<PathBuf>,
    /// Keep the scratch directory (bench.cpio, rig console) for inspection.
    #[arg(long)]
    keep_workdir: bool,
}

#[derive(Args, Debug)]
struct SnapArgs {
    /// Restore samples per contender (contenders alternate every sample).
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// Discarded restore runs per contender first.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Rounds of fork batches + cold fleet (each round: every batch size, then the
    /// memory comparison); 0 skips fork and memory.
    #[arg(long, default_value_t = 2)]
    fleet_samples: usize,
    /// Fork batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    children: Vec<usize>,
    /// VMs on each side of the memory comparison (the fork batch of this size is the
    /// forked side).
    #[arg(long, default_value_t = 100)]
    memory_vms: usize,
    /// Guest memory.
    #[arg(long, default_value_t = 64)]
    mem_mib: u32,
    /// Memory the guest touches (from 4 MiB up) before the snapshot and reads back after a
    /// restore.
    #[arg(long, default_value_t = 32)]
    touch_mib: u32,
    /// Window of the one `--record-working-set` run before the samples.
    #[arg(long, default_value_t = 1000)]
    record_ms: u64,
    /// Pause after a fleet is ready, before its memory is read and it is stopped.
    #[arg(long, default_value_t = 500)]
    settle_ms: u64,
    /// Per-VM readiness timeout (a cold fleet gets 4x).
    #[arg(long, default_value_t = 60)]
    timeout_s: u64,
    /// Write the full results (machine info, summaries, ratios, every sample) here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Our VMM binary [default: dsec-vmm next to this binary, else target/release, else PATH].
    #[arg(long, value_name = "PATH")]
    vmm: Option<PathBuf>,
    /// Samples per contender of the guest-inclusive scenario in the rig (Linux guest:
    /// restore MAP_PRIVATE / lazy / lazy + prefetch vs cold boot, to the first exec through
    /// the agent; one L1, about 10 s per sample); 0 skips it.
    #[arg(long, default_value_t = 3)]
    rig_samples: usize,
    /// The rig driver [default: tests/rig/rig.sh in the repo].
    #[arg(long, value_name = "PATH")]
    rig: Option<PathBuf>,
    /// Guest kernel for the rig [default: guest-kernel/build.sh's cached build].
    #[arg(long, value_name = "PATH")]
    guest_kernel: Option<PathBuf>,
    /// Agent initramfs for the rig [default: $DSEC_HOME/images/busybox/initramfs.cpio].
    #[arg(long, value_name = "PATH")]
    guest_initramfs: Option<PathBuf>,
    /// The dsec CLI run inside L1 [default: next to this binary, else target/release/dsec].
    #[arg(long, value_name = "PATH")]
    dsec: Option<PathBuf>,
    /// Guest memory in the rig.
    #[arg(long, default_value_t = 256)]
    rig_mem_mib: u32,
    /// Live full snapshots per contender of a running guest (the pause window of a fork's
    /// parent; contenders alternate); 0 skips them.
    #[arg(long, default_value_t = 9)]
    live_samples: usize,
    /// Guest memory of the live snapshots.
    #[arg(long, default_value_t = 1024)]
    live_mem_mib: u32,
    /// Memory that guest touches (an idle busybox fork parent has ~48 MiB in use).
    #[arg(long, default_value_t = 48)]
    live_touch_mib: u32,
    /// Another dsec-vmm build whose live snapshots alternate with ours (e.g. the build
    /// before a change).
    #[arg(long, value_name = "PATH")]
    baseline_vmm: Option<PathBuf>,
    /// Keep the scratch directory (snapshot, stderr of every VMM).
    #[arg(long)]
    keep_workdir: bool,
}

#[derive(Args, Debug)]
struct LayerfsArgs {
    /// The image: `debian` = debootstrap bookworm minbase + python3 and a large scientific
    /// stack, built once into ${DSEC_CACHE:-/var/cache/dsec}/perf/ (needs debootstrap and
    /// deb.debian.org); `host` = staged from this host's files; `auto` = debian, else host
    /// with a message.
    #[arg(long, default_value = "auto", value_name = "auto|debian|host")]
    image: layerfs::ImageChoice,
    /// Samples per contender in the cold and warm scenarios [default: 3; --quick: 1].
    #[arg(long)]
    samples: Option<usize>,
    /// Size budget of an image staged from this host's files, in MiB (what the first
    /// command needs always goes in; the Debian image is used whole) [default: 1024;
    /// --quick: 384].
    #[arg(long, value_name = "MIB")]
    image_mib: Option<u64>,
    /// Random 4 KiB reads per warm sample [default: 2000; --quick: 500].
    #[arg(long)]
    random_reads: Option<usize>,
    /// Small and fast (about 20 s on the 2-core dev machine): a smaller image, one sample,
    /// fewer random reads. Explicit options still win.
    #[arg(long)]
    quick: bool,
    /// Parent of the scratch directory; it must be on the filesystem of /usr (the image is
    /// staged as hard links, else copied) [default: the temp dir].
    #[arg(long, value_name = "DIR")]
    workdir: Option<PathBuf>,
    /// Write the full results (machine info, summaries, ratios, every sample) here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Keep the scratch directory (staged tree, store, the last extracted tree and cache).
    #[arg(long)]
    keep_workdir: bool,
}

#[derive(Args, Debug)]
struct ClusterArgs {
    /// The `dsec` binary (apiserver, sim nodes, node). Default: beside dsec-perf, else
    /// target/release/dsec.
    #[arg(long)]
    dsec: Option<PathBuf>,
    /// The apiserver binary (`dsec-control`, run as `PATH up ...`). Default: `dsec control
    /// up` (a `dsec-control` beside it may be stale: `cargo build -p dsec-cli` leaves it).
    #[arg(long, value_name = "PATH")]
    apiserver: Option<PathBuf>,
    /// Simulated nodes.
    #[arg(long, default_value_t = 160)]
    nodes: usize,
    /// Creates per round.
    #[arg(long, default_value_t = 10_000)]
    creates: usize,
    /// Concurrent SDK clients (one connection each).
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Rounds per replica count.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Apiserver replica counts to measure, comma-separated.
    #[arg(long, default_value = "1,2", value_delimiter = ',')]
    replicas: Vec<usize>,
    /// Real create -> first exec samples per path (0 skips the real node).
    #[arg(long, default_value_t = 20)]
    real_samples: usize,
    /// Creates per call, comma-separated: 0 = one Create per sandbox, N = CreateMany of N.
    /// Each round runs every mode in turn, so they alternate.
    #[arg(long, default_value = "0", value_delimiter = ',')]
    batch: Vec<usize>,
    #[arg(long)]
    json: Option<PathBuf>,
    #[arg(long)]
    keep_workdir: bool,
}

fn cluster_cmd(a: ClusterArgs) -> Result<(), String> {
    let root = repo_root();
    let workdir = std::env::temp_dir().join(format!("dsec-perf-cluster-{}", std::process::id()));
    let dsec = a
        .dsec
        .clone()
        .unwrap_or_else(|| default_beside_or_release(&root, "dsec"));
    let opts = cluster::ClusterOpts {
        dsec,
        apiserver: a.apiserver.clone(),
        workdir: workdir.clone(),
        nodes: a.nodes,
        creates: a.creates,
        clients: a.clients.max(1),
        rounds: a.rounds.max(1),
        replicas: a.replicas.clone(),
        real_samples: a.real_samples,
        batches: a.batch.clone(),
    };
    let result = cluster::run(&opts);
    finish_workdir(a.keep_workdir, &workdir);
    let (table, doc) = result?;
    print!("{table}");
    if let Some(path) = &a.json {
        let machine = json!({"cpus": std::thread::available_parallelism().map_or(0, |n| n.get()), "cpu_model": machine::cpu_model()});
        write_json(path, "cluster", &machine, doc)?;
    }
    Ok(())
}

#[derive(Args, Debug)]
struct NodeArgs {
    /// Sequential create -> first exec samples per contender (contenders alternate).
    #[arg(long, default_value_t = 30)]
    samples: usize,
    /// Discarded rounds before the samples.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Concurrent creates per burst.
    #[arg(long, default_value_t = 200)]
    burst: usize,
    /// Bursts per backend.
    #[arg(long, default_value_t = 3)]
    burst_rounds: usize,
    /// Exec round trips timed in the warm sandbox.
    #[arg(long, default_value_t = 300)]
    exec_samples: usize,
    /// Backends to measure; microvm is skipped (reason in the JSON) where a Linux guest
    /// cannot boot.
    #[arg(long, value_delimiter = ',', default_value = "container,microvm")]
    backends: Vec<String>,
    /// Memory of each sandbox (admission budget and cgroup limit).
    #[arg(long, default_value_t = 64)]
    memory_mib: i64,
    /// Writable disk of each sandbox.
    #[arg(long, default_value_t = 64)]
    disk_mib: i64,
    /// The daemon [default: dsec-edge next to this binary, else target/release, else PATH;
    /// it uses the dsec-agent next to itself].
    #[arg(long, value_name = "PATH")]
    edge: Option<PathBuf>,
    /// Rootfs of the baselines [default: $DSEC_HOME/images/busybox/rootfs, the image the
    /// daemon uses].
    #[arg(long, value_name = "DIR")]
    rootfs: Option<PathBuf>,
    /// Seconds to wait for the daemon to serve.
    #[arg(long, default_value_t = 30)]
    timeout_s: u64,
    /// Write the full results (machine info, summaries, ratios, every sample) here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Parent of the scratch directory holding the daemon's state dir [default: /run, where
    /// a default node keeps its state].
    #[arg(long, value_name = "DIR")]
    workdir: Option<PathBuf>,
    /// Keep the scratch directory (the daemon's log).
    #[arg(long)]
    keep_workdir: bool,
}

#[derive(Args, Debug)]
struct RigInnerArgs {
    /// Contenders to boot, in order (ours, qemu), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    order: Vec<String>,
    #[arg(long, default_value = "/bin/dsec-vmm")]
    vmm: PathBuf,
    #[arg(long, default_value = "/usr/bin/qemu-system-x86_64")]
    qemu: PathBuf,
    #[arg(long, default_value = "/bin/firecracker")]
    firecracker: PathBuf,
    #[arg(long, default_value = "/guest/vmlinux")]
    kernel: PathBuf,
    #[arg(long, default_value = "/guest/initramfs.cpio")]
    initrd: PathBuf,
    #[arg(long, default_value_t = 256)]
    mem_mib: u32,
    #[arg(long, default_value_t = 120)]
    timeout_s: u64,
    #[arg(long, default_value = "/tmp/dsec-perf")]
    workdir: PathBuf,
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    cmdline_extra: String,
    /// Read-only root disk (vda); each boot also gets a fresh upper disk (vdb).
    #[arg(long, value_name = "PATH")]
    root_disk: Option<PathBuf>,
    /// mkfs.ext4 for the upper disks.
    #[arg(long, default_value = "/bin/mkfs.ext4")]
    mkfs: PathBuf,
}

/// The repository root: upward from the current directory, else where this was built.
fn repo_root() -> PathBuf {
    let is_root =
        |d: &Path| d.join("perf/rig/boot-in-l1.sh").is_file() && d.join("Cargo.toml").is_file();
    if let Ok(cwd) = std::env::current_dir() {
        if let Some(d) = cwd.ancestors().find(|d| is_root(d)) {
            return d.to_path_buf();
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn default_vmm(root: &Path) -> PathBuf {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join("dsec-vmm")));
    if let Some(p) = beside.filter(|p| p.is_file()) {
        return p;
    }
    let built = root.join("target/release/dsec-vmm");
    if built.is_file() {
        return built;
    }
    direct::which(Path::new("dsec-vmm")).unwrap_or(built)
}

/// The `serial` test guest, (re)built by cargo (a no-op when fresh) into target/test-guests.
fn default_guest(root: &Path) -> PathBuf {
    let target_dir = root.join("target/test-guests");
    let guest = target_dir.join("x86_64-unknown-linux-gnu/release/serial");
    // The guests' .cargo/config.toml is only read when cargo runs in their directory.
    let status = Command::new("cargo")
        .args([
            "build",
            "--quiet",
            "--release",
            "--bin",
            "serial",
            "--target-dir",
        ])
        .arg(&target_dir)
        .current_dir(root.join("vmm/test-guests"))
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        eprintln!("dsec-perf: building the test guest failed ({status:?}); using what is there");
    }
    guest
}

/// guest-kernel/build.sh's cached vmlinux (never builds it), or why there is none.
fn default_kernel(root: &Path) -> Result<PathBuf, String> {
    let script = root.join("guest-kernel/build.sh");
    let out = Command::new(&script)
        .arg("--print-dir")
        .stderr(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let k = Path::new(&dir).join("vmlinux");
    if out.status.success() && k.is_file() {
        Ok(k)
    } else {
        Err(format!(
            "guest kernel not built: no {} (run guest-kernel/build.sh, ~7 min, or pass --guest-kernel)",
            k.display()
        ))
    }
}

/// `$DSEC_HOME`, else the default node home.
fn dsec_home() -> PathBuf {
    std::env::var_os("DSEC_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/dsec"))
}

fn default_initramfs(root: &Path) -> Option<PathBuf> {
    let home = dsec_home();
    [
        home.join("images/busybox/initramfs.cpio"),
        root.join("target/images/busybox/initramfs.cpio"),
    ]
    .into_iter()
    .find(|p| p.is_file())
}

fn boot(a: BootArgs) -> Result<(), String> {
    let root = repo_root();
    let workdir = std::env::temp_dir().join(format!("dsec-perf-{}", std::process::id()));
    std::fs::create_dir_all(&workdir).map_err(|e| format!("create {}: {e}", workdir.display()))?;
    let vmm = a.vmm.clone().unwrap_or_else(|| default_vmm(&root));
    let qemu = direct::which(&a.qemu).unwrap_or(a.qemu.clone());
    let machine = machine::info(&qemu);
    eprintln!(
        "dsec-perf: kvm={} cpu={:?} vmm={} qemu={}",
        machine["kvm_kind"].as_str().unwrap_or("?"),
        machine["cpu_model"].as_str().unwrap_or("?"),
        vmm.display(),
        qemu.display()
    );

    let direct_opts = direct::DirectOpts {
        vmm: vmm.clone(),
        qemu: qemu.clone(),
        guest: a.guest.clone().unwrap_or_else(|| default_guest(&root)),
        samples: a.samples,
        warmup: a.warmup,
        accels: a.qemu_accel.clone(),
        timeout: Duration::from_secs(a.timeout_s),
        done_marker: a.done_marker.clone(),
        mem_mib: a.mem_mib,
        workdir: workdir.join("direct"),
    };
    std::fs::create_dir_all(&direct_opts.workdir).map_err(|e| e.to_string())?;
    let direct = if a.skip_direct {
        let mut sc = direct::scenario_skeleton(&direct_opts);
        sc.skipped = Some("--skip-direct".into());
        sc
    } else {
        direct::bench(&direct_opts)
    };
    print!("{}", direct.table());

    let rig_opts = rig::OuterOpts {
        samples: a.rig_samples,
        shared_l1: a.rig_shared_l1,
        rig: a
            .rig
            .clone()
            .unwrap_or_else(|| root.join("tests/rig/rig.sh")),
        kernel: match a.guest_kernel.clone() {
            Some(k) => Ok(k),
            None => default_kernel(&root),
        },
        initramfs: a
            .guest_initramfs
            .clone()
            .or_else(|| default_initramfs(&root)),
        vmm,
        qemu,
        firecracker: a.firecracker.clone(),
        mem_mib: a.rig_mem_mib,
        boot_timeout: Duration::from_secs(a.rig_boot_timeout_s),
        workdir: workdir.join("rig"),
        cmdline_extra: a.rig_cmdline_extra.clone(),
        root_disk: None,
    };
    let rig = rig::bench(&rig_opts);
    println!();
    print!("{}", rig.table());

    let disk_opts = rig::OuterOpts {
        samples: a.rig_disk_samples,
        workdir: workdir.join("rig-disk"),
        root_disk: Some(
            a.root_disk
                .clone()
                .unwrap_or_else(|| dsec_home().join("images/debian/rootfs.img")),
        ),
        ..rig_opts
    };
    let rig_disk = if disk_opts.samples == 0 {
        let mut sc = rig::skeleton(&disk_opts);
        sc.skipped = Some("--rig-disk-samples 0".into());
        sc
    } else {
        rig::bench(&disk_opts)
    };
    println!();
    print!("{}", rig_disk.table());

    if let Some(path) = &a.json {
        write_json(
            path,
            "boot",
            &machine,
            json!({
                "direct": direct.to_json(),
                "rig": rig.to_json(),
                "rig_disk": rig_disk.to_json(),
            }),
        )?;
    }
    finish_workdir(a.keep_workdir, &workdir);
    Ok(())
}

fn snapshot_cmd(a: SnapArgs) -> Result<(), String> {
    let root = repo_root();
    let workdir = std::env::temp_dir().join(format!("dsec-perf-snap-{}", std::process::id()));
    std::fs::create_dir_all(&workdir).map_err(|e| format!("create {}: {e}", workdir.display()))?;
    let vmm = a.vmm.clone().unwrap_or_else(|| default_vmm(&root));
    let machine = machine::info(Path::new("qemu-system-x86_64"));
    eprintln!(
        "dsec-perf: kvm={} cpu={:?} vmm={}",
        machine["kvm_kind"].as_str().unwrap_or("?"),
        machine["cpu_model"].as_str().unwrap_or("?"),
        vmm.display()
    );
    let opts = snapshot::SnapOpts {
        vmm,
        samples: a.samples,
        warmup: a.warmup,
        fleet_samples: a.fleet_samples,
        children: a.children.clone(),
        memory_vms: a.memory_vms,
        mem_mib: a.mem_mib,
        touch_mib: a.touch_mib,
        record_ms: a.record_ms,
        timeout: Duration::from_secs(a.timeout_s),
        settle: Duration::from_millis(a.settle_ms),
        workdir: workdir.clone(),
    };
    let live = live_snapshot::bench(&live_snapshot::LiveOpts {
        vmm: opts.vmm.clone(),
        baseline_vmm: a.baseline_vmm.clone(),
        samples: a.live_samples,
        mem_mib: a.live_mem_mib,
        touch_mib: a.live_touch_mib,
        timeout: opts.timeout,
        workdir: workdir.join("live"),
    });
    let r = snapshot::bench(&opts);
    let dsec = a.dsec.clone().unwrap_or_else(|| {
        let beside = opts.vmm.with_file_name("dsec");
        if beside.is_file() {
            beside
        } else {
            root.join("target/release/dsec")
        }
    });
    let rig_restore = rig_snapshot::bench(&rig_snapshot::RigSnapOpts {
        samples: a.rig_samples,
        rig: a
            .rig
            .clone()
            .unwrap_or_else(|| root.join("tests/rig/rig.sh")),
        kernel: a
            .guest_kernel
            .clone()
            .map(Ok)
            .unwrap_or_else(|| default_kernel(&root)),
        initramfs: a
            .guest_initramfs
            .clone()
            .or_else(|| default_initramfs(&root)),
        dsec,
        vmm: opts.vmm.clone(),
        mem_mib: a.rig_mem_mib,
        record_ms: 2000,
        workdir: workdir.join("rig"),
    });
    print!("{}", r.restore.table());
    println!();
    print!("{}", r.kvm.table());
    println!();
    print!("{}", r.fork.table());
    println!();
    print!("{}", r.memory.table());
    println!();
    print!("{}", rig_restore.table());
    println!();
    print!("{}", live.table());
    if let Some(path) = &a.json {
        write_json(
            path,
            "snapshot",
            &machine,
            json!({
                "options": {
                    "samples": a.samples, "warmup": a.warmup, "fleet_samples": a.fleet_samples,
                    "children": a.children, "memory_vms": a.memory_vms, "mem_mib": a.mem_mib,
                    "touch_mib": a.touch_mib, "record_ms": a.record_ms, "settle_ms": a.settle_ms,
                    "rig_samples": a.rig_samples, "rig_mem_mib": a.rig_mem_mib,
                    "live_samples": a.live_samples, "live_mem_mib": a.live_mem_mib,
                    "live_touch_mib": a.live_touch_mib, "baseline_vmm": a.baseline_vmm,
                },
                "live": live.to_json(),
                "restore": r.restore.to_json(),
                "kvm": r.kvm.to_json(),
                "fork": r.fork.to_json(),
                "memory": r.memory.to_json(),
                "rig_restore": rig_restore.to_json(),
            }),
        )?;
    }
    finish_workdir(a.keep_workdir, &workdir);
    Ok(())
}

fn devices_cmd(a: DevicesArgs) -> Result<(), String> {
    let root = repo_root();
    let workdir = std::env::temp_dir().join(format!("dsec-perf-devices-{}", std::process::id()));
    let machine = machine::info(Path::new("qemu-system-x86_64"));
    let opts = rig_devices::RigDevOpts {
        samples: a.samples,
        rig: a
            .rig
            .clone()
            .unwrap_or_else(|| root.join("tests/rig/rig.sh")),
        kernel: a
            .guest_kernel
            .clone()
            .map(Ok)
            .unwrap_or_else(|| default_kernel(&root)),
        initramfs: a
            .guest_initramfs
            .clone()
            .or_else(|| default_initramfs(&root)),
        guest_bench: a.guest_bench.clone().unwrap_or_else(|| {
            root.join("target/x86_64-unknown-linux-gnu/release/dsec-guest-bench")
        }),
        vmm: a.vmm.clone().unwrap_or_else(|| default_vmm(&root)),
        mem_mib: a.mem_mib,
        disk_mib: a.disk_mib,
        rand_reads: a.rand_reads,
        tcp_mib: a.tcp_mib,
        workdir: workdir.clone(),
    };
    let sc = rig_devices::bench(&opts);
    print!("{}", sc.table());
    if let Some(path) = &a.json {
        write_json(
            path,
            "devices",
            &machine,
            json!({
                "options": {
                    "samples": a.samples, "mem_mib": a.mem_mib, "disk_mib": a.disk_mib,
                    "rand_reads": a.rand_reads, "tcp_mib": a.tcp_mib,
                },
                "rig_devices": sc.to_json(),
            }),
        )?;
    }
    finish_workdir(a.keep_workdir, &workdir);
    match &sc.skipped {
        Some(why) => Err(format!("device scenario skipped: {why}")),
        None => Ok(()),
    }
}

fn layerfs_cmd(a: LayerfsArgs) -> Result<(), String> {
    let opts = layerfs::LayerfsOpts {
        image: a.image,
        samples: layerfs::pick(a.samples, a.quick, 1, 3),
        image_bytes: layerfs::pick(a.image_mib, a.quick, 384, 1024) << 20,
        random_reads: layerfs::pick(a.random_reads, a.quick, 500, 2000),
        workdir: a
            .workdir
            .clone()
            .unwrap_or_else(std::env::temp_dir)
            .join(format!("dsec-perf-layerfs-{}", std::process::id())),
    };
    let machine = machine::info(Path::new("qemu-system-x86_64"));
    eprintln!(
        "dsec-perf: layerfs, cpu={:?}, {} samples, image budget {} MiB, scratch {}",
        machine["cpu_model"].as_str().unwrap_or("?"),
        opts.samples,
        opts.image_bytes >> 20,
        opts.workdir.display()
    );
    layerfs::check_prerequisites().map_err(|e| e.to_string())?;
    std::fs::create_dir(&opts.workdir).map_err(|e| {
        format!(
            "creating the scratch directory {}: {e} (it must not exist yet; choose another --workdir)",
            opts.workdir.display()
        )
    })?;
    let result = layerfs::bench(&opts);
    let finish = |r: &layerfs::Results| -> Result<(), String> {
        for sc in [&r.import, &r.cold, &r.warm] {
            print!("{}", sc.table());
            println!();
        }
        if let Some(path) = &a.json {
            write_json(
                path,
                "layerfs",
                &machine,
                json!({
                    "options": {
                        "image": format!("{:?}", opts.image).to_lowercase(),
                        "samples": opts.samples, "image_mib": opts.image_bytes >> 20,
                        "random_reads": opts.random_reads, "quick": a.quick,
                    },
                    "image": r.image,
                    "import": r.import.to_json(),
                    "cold": r.cold.to_json(),
                    "warm": r.warm.to_json(),
                }),
            )?;
        }
        Ok(())
    };
    let out = match &result {
        Ok(r) => finish(r),
        Err(e) => Err(e.to_string()),
    };
    finish_workdir(a.keep_workdir, &opts.workdir);
    out
}

fn default_beside_or_release(root: &Path, name: &str) -> PathBuf {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join(name)));
    if let Some(p) = beside.filter(|p| p.is_file()) {
        return p;
    }
    let built = root.join("target/release").join(name);
    if built.is_file() {
        return built;
    }
    direct::which(Path::new(name)).unwrap_or(built)
}

fn node_cmd(a: NodeArgs) -> Result<(), String> {
    let root = repo_root();
    let home = dsec_home();
    // Beside a default node's state dir (/run/dsec): the daemon's per-create fsync of
    // meta.json then costs what it costs a default node on this host.
    let parent = a.workdir.clone().unwrap_or_else(|| {
        let run = PathBuf::from("/run");
        if run.is_dir() {
            run
        } else {
            std::env::temp_dir()
        }
    });
    let workdir = parent.join(format!("dsec-perf-node-{}", std::process::id()));
    let opts = node::NodeOpts {
        edge: a
            .edge
            .clone()
            .unwrap_or_else(|| default_beside_or_release(&root, "dsec-edge")),
        rootfs: a
            .rootfs
            .clone()
            .unwrap_or_else(|| home.join("images/busybox/rootfs")),
        bwrap: direct::which(Path::new("bwrap")),
        unshare: direct::which(Path::new("unshare")),
        backends: a.backends.clone(),
        samples: a.samples,
        warmup: a.warmup,
        burst: a.burst,
        burst_rounds: a.burst_rounds,
        exec_samples: a.exec_samples,
        memory_mib: a.memory_mib,
        disk_mib: a.disk_mib,
        timeout: Duration::from_secs(a.timeout_s),
        workdir: workdir.clone(),
    };
    let machine = machine::info(Path::new("qemu-system-x86_64"));
    let kvm_kind = machine["kvm_kind"]
        .as_str()
        .unwrap_or("unknown")
        .to_string();
    eprintln!(
        "dsec-perf: node, kvm={kvm_kind} cpu={:?} edge={} rootfs={}",
        machine["cpu_model"].as_str().unwrap_or("?"),
        opts.edge.display(),
        opts.rootfs.display()
    );
    std::fs::create_dir_all(&workdir).map_err(|e| format!("create {}: {e}", workdir.display()))?;
    let result = node::bench(&opts, &kvm_kind);
    let out = result.map_err(|e| e.to_string()).and_then(|r| {
        for sc in [&r.create, &r.burst, &r.exec] {
            print!("{}", sc.table());
            println!();
        }
        if let Some(path) = &a.json {
            write_json(
                path,
                "node",
                &machine,
                json!({
                    "options": {
                        "samples": a.samples, "warmup": a.warmup, "burst": a.burst,
                        "burst_rounds": a.burst_rounds, "exec_samples": a.exec_samples,
                        "memory_mib": a.memory_mib, "disk_mib": a.disk_mib,
                        "rootfs": opts.rootfs, "edge": opts.edge, "workdir": workdir,
                    },
                    "edge_command": r.edge_command,
                    "backends": r.backends,
                    "create": r.create.to_json(),
                    "burst": r.burst.to_json(),
                    "exec": r.exec.to_json(),
                }),
            )?;
        }
        Ok(())
    });
    finish_workdir(a.keep_workdir, &workdir);
    out
}

fn net_cmd(a: NetArgs) -> Result<(), String> {
    // SAFETY: geteuid has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err("the net benchmark needs root (namespaces, a bridge, nftables)".into());
    }
    if a.held.is_empty() || a.rules == 0 || a.samples == 0 {
        return Err("--held, --rules and --samples must not be empty or 0".into());
    }
    let root = repo_root();
    let workdir = std::env::temp_dir().join(format!("dsec-perf-net-{}", std::process::id()));
    std::fs::create_dir_all(&workdir).map_err(|e| format!("create {}: {e}", workdir.display()))?;
    let opts = net::NetOpts {
        edge: a
            .edge
            .clone()
            .unwrap_or_else(|| default_beside_or_release(&root, "dsec-edge")),
        workdir: workdir.clone(),
        samples: a.samples,
        held: a.held.clone(),
        rules: a.rules,
        transfer_mib: a.transfer_mib,
        connections: a.connections,
        policy_samples: a.policy_samples,
        live_samples: a.live_samples,
        live_load: a.live_load,
        edge_args: a.edge_args.clone(),
    };
    let machine = machine::info(Path::new("qemu-system-x86_64"));
    let result = net::bench(&opts);
    let _ = std::fs::remove_dir_all(&workdir);
    let r = result?;
    for sc in [&r.setup, &r.growth, &r.policy, &r.live] {
        print!("{}", sc.table());
        println!();
    }
    if let Some(path) = &a.json {
        write_json(
            path,
            "net",
            &machine,
            json!({
                "options": {
                    "samples": a.samples, "held": a.held, "rules": a.rules,
                    "transfer_mib": a.transfer_mib, "connections": a.connections,
                    "policy_samples": a.policy_samples, "live_samples": a.live_samples,
                    "live_load": a.live_load, "edge_args": a.edge_args, "edge": opts.edge,
                },
                "edge_commands": r.commands,
                "setup": r.setup.to_json(),
                "growth": r.growth.to_json(),
                "policy": r.policy.to_json(),
                "live": r.live.to_json(),
            }),
        )?;
    }
    Ok(())
}

fn fncall_cmd(a: FncallArgs) -> Result<(), String> {
    let root = repo_root();
    let dsec = a
        .dsec
        .clone()
        .unwrap_or_else(|| default_beside_or_release(&root, "dsec"));
    let opts = fncall::FnOpts {
        images: a.images.clone().unwrap_or_else(fncall::default_images),
        image: a.image.clone(),
        bwrap: direct::which(Path::new("bwrap")),
        dsec: dsec.is_file().then_some(dsec),
        samples: a.samples,
        run_samples: a.run_samples,
        concurrency: a.concurrency.clone(),
        rounds: a.rounds,
        round_scale: a.round_scale,
        python_workers: a.python_workers,
        snippets: a.snippets.clone(),
    };
    fncall::check_image(&opts)?;
    let machine = machine::info(Path::new("qemu-system-x86_64"));
    let r = fncall::bench(&opts)?;
    for sc in [&r.latency, &r.throughput] {
        print!("{}", sc.table());
        println!();
    }
    if let Some(path) = &a.json {
        let mut fields = fncall::to_json(&r);
        fields["options"] = json!({
            "samples": a.samples, "run_samples": a.run_samples, "concurrency": a.concurrency,
            "rounds": a.rounds, "python_workers": a.python_workers, "image": a.image,
            "snippets": a.snippets,
        });
        write_json(path, "fncall", &machine, fields)?;
    }
    Ok(())
}

fn fncall_vm_cmd(a: FncallVmArgs) -> Result<(), String> {
    let opts = fncall_vm::FnVmOpts {
        endpoint: a
            .endpoint
            .clone()
            .or_else(|| std::env::var("DSEC_ENDPOINT").ok())
            .unwrap_or_else(|| dsec_sdk::DEFAULT_TARGET.to_string()),
        vm_image: a.vm_image.clone(),
        container_image: a.container_image.clone(),
        dsec: a
            .dsec
            .clone()
            .unwrap_or_else(|| default_beside_or_release(&repo_root(), "dsec")),
        samples: a.samples,
        cold_samples: a.cold_samples,
    };
    let scenario = fncall_vm::bench(&opts)?;
    print!("{}", scenario.table());
    let mut fields = json!({ "fncall_vm": scenario.to_json() });
    fields["options"] = json!({
        "samples": a.samples, "cold_samples": a.cold_samples,
        "vm_image": a.vm_image, "container_image": a.container_image,
    });
    // One line the rig suite can pick out of the console.
    println!("PERF-FNCALL-VM {fields}");
    if let Some(path) = &a.json {
        write_json(
            path,
            "fncall-vm",
            &machine::info(Path::new("qemu-system-x86_64")),
            fields,
        )?;
    }
    Ok(())
}

fn templates_cmd(a: TemplatesArgs) -> Result<(), String> {
    let opts = templates::TemplateOpts {
        endpoint: a
            .endpoint
            .clone()
            .or_else(|| std::env::var("DSEC_ENDPOINT").ok())
            .unwrap_or_else(|| dsec_sdk::DEFAULT_TARGET.to_string()),
        samples: a.samples,
        memory_mib: a.memory_mib,
    };
    let scenario = templates::bench(&opts)?;
    print!("{}", scenario.table());
    let mut fields = json!({ "templates": scenario.to_json() });
    fields["options"] = json!({ "samples": a.samples, "memory_mib": a.memory_mib });
    // One line the rig suite can pick out of the console.
    println!("PERF-TEMPLATES {fields}");
    if let Some(path) = &a.json {
        write_json(
            path,
            "templates",
            &machine::info(Path::new("qemu-system-x86_64")),
            fields,
        )?;
    }
    Ok(())
}

/// Writes a scenario's results as JSON: the common envelope (tool, scenario, version, time,
/// machine) plus `fields`.
fn write_json(path: &Path, scenario: &str, machine: &Value, fields: Value) -> Result<(), String> {
    let mut doc = json!({
        "tool": "dsec-perf",
        "scenario": scenario,
        "version": env!("CARGO_PKG_VERSION"),
        "finished_unix_s": run::realtime_ns() / 1_000_000_000,
        "machine": machine,
    });
    if let (Some(doc), Value::Object(fields)) = (doc.as_object_mut(), fields) {
        doc.extend(fields);
    }
    let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n").map_err(|e| format!("write {}: {e}", path.display()))?;
    eprintln!("dsec-perf: wrote {}", path.display());
    Ok(())
}

/// Keeps the scratch directory for inspection (`--keep-workdir`) or removes it.
fn finish_workdir(keep: bool, workdir: &Path) {
    if keep {
        eprintln!("dsec-perf: scratch kept in {}", workdir.display());
    } else {
        let _ = std::fs::remove_dir_all(workdir);
    }
}

fn exit_code(result: Result<(), String>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dsec-perf: {e}");
            ExitCode::from(1)
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Boot(a) => exit_code(boot(a)),
        Cmd::Snapshot(a) => exit_code(snapshot_cmd(a)),
        Cmd::Devices(a) => exit_code(devices_cmd(a)),
        Cmd::Layerfs(a) => exit_code(layerfs_cmd(a)),
        Cmd::Node(a) => exit_code(node_cmd(a)),
        Cmd::Net(a) => exit_code(net_cmd(a)),
        Cmd::Fncall(a) => exit_code(fncall_cmd(a)),
        Cmd::FncallVm(a) => exit_code(fncall_vm_cmd(a)),
        Cmd::Templates(a) => exit_code(templates_cmd(a)),
        Cmd::Cluster(a) => exit_code(cluster_cmd(a)),
        Cmd::RigInner(a) => {
            let failed = rig::inner(&rig::InnerOpts {
                order: a.order,
                vmm: a.vmm,
                qemu: a.qemu,
                firecracker: a.firecracker,
                kernel: a.kernel,
                initrd: a.initrd,
                mem_mib: a.mem_mib,
                timeout: Duration::from_secs(a.timeout_s),
                workdir: a.workdir,
                cmdline_extra: a.cmdline_extra,
                root_disk: a.root_disk.map(|image| rig::RootDisk {
                    image,
                    mkfs: a.mkfs,
                    upper_mib: rig::UPPER_MIB,
                }),
            });
            ExitCode::from(failed.min(255) as u8)
        }
    }
}
