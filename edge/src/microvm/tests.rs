use super::*;
use dsec_vmm_api::{RestoreLaunch, VmConfig};

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dsec-microvm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A stand-in for dsec-vmm: a shell script.
fn fake_vmm(dir: &Path, body: &str) -> SpawnOptions {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("fake-vmm");
    std::fs::write(&bin, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    SpawnOptions {
        vmm_bin: bin,
        cgroup_procs: Vec::new(),
        nice: 0,
    }
}

/// Boots `options`' fake VMM in `<dir>/vm`.
fn boot_fake(dir: &Path, options: &SpawnOptions) -> (MicroVmDir, StartingMicroVm) {
    let vm_dir = MicroVmDir::new(dir.join("vm"));
    std::fs::create_dir_all(vm_dir.path()).unwrap();
    let starting = MicroVm::spawn(
        options,
        &vm_dir,
        VmmLaunch::boot(VmConfig::new("/k/vmlinux")),
    )
    .unwrap();
    (vm_dir, starting)
}

/// The nice value of every thread of `pid` and of its children.
fn nice_values(pid: u32) -> Vec<i64> {
    let mut pids = vec![pid];
    if let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")) {
        pids.extend(text.split_whitespace().map(|p| p.parse::<u32>().unwrap()));
    }
    let mut values = Vec::new();
    for pid in pids {
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
        {
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap();
            // Field 19 is the nice value; fields after the ')' of the command name start at 3.
            let after = &stat[stat.rfind(')').unwrap() + 2..];
            values.push(after.split(' ').nth(16).unwrap().parse().unwrap());
        }
    }
    values
}

#[tokio::test]
async fn a_prewarmed_vmm_starts_at_low_priority_and_is_put_back_when_taken() {
    let dir = tempdir("nice");
    let options = SpawnOptions {
        nice: 19,
        ..fake_vmm(&dir, "sleep 60 & exec sleep 60")
    };
    let (_, starting) = boot_fake(&dir, &options);
    let pid = starting.pid();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while nice_values(pid).len() < 2 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let started = nice_values(pid);
    assert!(
        started.len() >= 2 && started.iter().all(|n| *n == 19),
        "{started:?}"
    );
    starting.renice(0).unwrap();
    let taken = nice_values(pid);
    assert!(taken.iter().all(|n| *n == 0), "{taken:?}");
    drop(starting);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_launch_is_wired_to_the_directory() {
    let dir = MicroVmDir::new("/run/vm-1");
    let mut config = VmConfig::new("/k");
    config.vsock = Some(VsockConfig {
        uds_path: "/elsewhere".into(),
        guest_cid: 9,
    });
    let mut boot = VmmLaunch::boot(config);
    dir.wire(&mut boot);
    assert_eq!(
        boot.api_sock.as_deref(),
        Some(Path::new("/run/vm-1/api.sock"))
    );
    let LaunchMode::Boot(c) = &boot.mode else {
        panic!("{boot:?}")
    };
    let vsock = c.vsock.as_ref().unwrap();
    assert_eq!(
        (vsock.uds_path.as_path(), vsock.guest_cid),
        (Path::new("/run/vm-1/vsock.sock"), 9)
    );
    assert_eq!(c.serial, SerialOutput::File("/run/vm-1/serial.log".into()));

    let mut restore = VmmLaunch::restore(RestoreLaunch::new("/snap"));
    dir.wire(&mut restore);
    let o = restore.snapshot_overrides_mut().unwrap();
    assert_eq!(
        o.vsock_uds.as_deref(),
        Some(Path::new("/run/vm-1/vsock.sock"))
    );
    assert_eq!(
        o.serial,
        Some(SerialOutput::File("/run/vm-1/serial.log".into()))
    );
}

#[tokio::test]
async fn a_vmm_that_exits_is_reported_with_its_log() {
    let dir = tempdir("exits");
    let options = fake_vmm(&dir, "echo \"cannot open /dev/kvm; args: $*\" >&2\nexit 1");
    let (vm_dir, starting) = boot_fake(&dir, &options);
    let pid = std::fs::read_to_string(vm_dir.pid_file()).unwrap();
    assert_eq!(pid, starting.pid().to_string());
    let err = starting.ready(Duration::from_secs(10)).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, EdgeError::SandboxDied { .. }), "{text}");
    assert!(text.contains("cannot open /dev/kvm"), "{text}");
    // The VMM got the rendered launch, wired to its directory.
    assert!(
        text.contains("--kernel /k/vmlinux") && text.contains("vm/api.sock"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn a_guest_that_never_answers_times_out_and_its_vmm_is_killed() {
    let dir = tempdir("silent");
    let options = fake_vmm(&dir, "exec sleep 60");
    let vm_dir = MicroVmDir::new(dir.join("vm"));
    std::fs::create_dir_all(vm_dir.path()).unwrap();
    std::fs::write(vm_dir.serial_log(), "guest kernel panic\n").unwrap();
    let starting = MicroVm::spawn(
        &options,
        &vm_dir,
        VmmLaunch::restore(RestoreLaunch::new("/snap")),
    )
    .unwrap();
    let pid = starting.pid() as i32;
    let err = starting
        .ready(Duration::from_millis(200))
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, EdgeError::AgentNotReady { .. }), "{text}");
    assert!(text.contains("guest kernel panic"), "{text}");
    // Killed and reaped: the pid is gone.
    assert!(kill(Pid::from_raw(pid), None).is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn control_calls_from_async_code_map_to_edge_errors() {
    let dir = tempdir("control");
    let client = MicroVmDir::new(&dir).control();
    let err = control_call::<dsec_vmm_api::control::StatusReply>(client, Request::Status)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            EdgeError::Vmm(dsec_vmm_api::ControlError::Connect { .. })
        ),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn random_macs_are_local_unicast() {
    let mac = random_mac().unwrap();
    let parsed = dsec_vmm_api::config::parse_mac(&mac).unwrap();
    assert_eq!(parsed[0], 0x06);
    assert_ne!(mac, random_mac().unwrap());
}
