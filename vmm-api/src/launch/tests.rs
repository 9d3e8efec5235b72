use super::*;

/// Renders, parses back and checks the launch is unchanged.
fn round_trip(launch: VmmLaunch) {
    let argv = std::iter::once(OsString::from("dsec-vmm")).chain(launch.to_args());
    let parsed = VmmLaunch::parse_from(argv)
        .unwrap_or_else(|e| panic!("{launch:?} rendered as {:?}: {e}", launch.to_args()));
    assert_eq!(parsed, launch, "argv {:?}", launch.to_args());
}

fn full_config() -> VmConfig {
    let mut c = VmConfig::new("/k/vmlinux");
    c.initrd = Some("/k/initramfs.cpio".into());
    c.cmdline = "console=ttyS0 quiet dsec.root=/dev/vda".into();
    c.vcpus = 2;
    c.mem_mib = 512;
    c.vsock = Some(VsockConfig {
        uds_path: "/run/vm/vsock.sock".into(),
        guest_cid: 7,
    });
    c.serial = SerialOutput::File("/run/vm/serial.log".into());
    c.rng = true;
    c.drives = vec![
        "/img/root,1.ext4,ro".parse().unwrap(),
        "/run/vm/upper.ext4".parse().unwrap(),
    ];
    c.net = Some("tap=tap0,mac=06:00:00:00:00:02".parse().unwrap());
    c.balloon = Some("deflate-on-oom,stats=5,reporting".parse().unwrap());
    c.pmem = vec![
        "/img/a.img,ro".parse().unwrap(),
        "/img/b.img,shared".parse().unwrap(),
        "/img/c.img".parse().unwrap(),
    ];
    c
}

fn jail() -> JailLaunch {
    JailLaunch {
        root: "/run/dsec/jails/vm-1".into(),
        uid: 1000,
        gid: 1001,
        netns: Some("/run/netns/sb1".into()),
        expose: vec![
            "/snap/vm-1,rw".parse().unwrap(),
            "/images/busybox".parse().unwrap(),
        ],
        check: Some("/etc/shadow".into()),
    }
}

fn overrides() -> SnapshotOverrides {
    SnapshotOverrides {
        vsock_uds: Some("/run/c/vsock.sock".into()),
        vsock_cid: Some(41),
        net: Some("tap=fk0,mac=06:11:22:33:44:55".parse().unwrap()),
        drives: vec![
            "/img/root.ext4,ro".parse().unwrap(),
            "/c/upper.ext4".parse().unwrap(),
        ],
        serial: Some(SerialOutput::File("/run/c/serial.log".into())),
        contained_chain: true,
    }
}

#[test]
fn boot_round_trips() {
    round_trip(VmmLaunch::boot(VmConfig::new("/k/vmlinux")));
    let mut plain_balloon = VmConfig::new("/k");
    plain_balloon.balloon = Some(BalloonConfig::default());
    plain_balloon.serial = SerialOutput::Stdout;
    plain_balloon.cmdline = String::new();
    round_trip(VmmLaunch::boot(plain_balloon));
    let mut everything = VmmLaunch::boot(full_config());
    everything.api_sock = Some("/run/vm/api.sock".into());
    everything.paused = true;
    everything.metrics_json = Some("/run/vm/metrics.json".into());
    everything.no_seccomp = true;
    everything.jail = Some(jail());
    round_trip(everything);
}

#[test]
fn boot_file_round_trips() {
    round_trip(VmmLaunch::new(LaunchMode::BootFile {
        config: "/etc/vm.json".into(),
        overrides: BootOverrides::default(),
    }));
    let c = full_config();
    round_trip(VmmLaunch::new(LaunchMode::BootFile {
        config: "/etc/vm.json".into(),
        overrides: BootOverrides {
            kernel: Some(c.kernel),
            initrd: c.initrd,
            cmdline: Some(c.cmdline),
            vcpus: Some(4),
            mem_mib: Some(128),
            vsock_uds: Some("/v.sock".into()),
            vsock_cid: Some(9),
            rng: true,
            drives: c.drives,
            net: c.net,
            balloon: c.balloon,
            pmem: c.pmem,
            serial: Some(SerialOutput::Stdout),
        },
    }));
}

#[test]
fn restore_round_trips() {
    round_trip(VmmLaunch::restore(RestoreLaunch::new("/snap")));
    for lazy in [
        LazyLaunch::default(),
        LazyLaunch {
            prefetch: true,
            record_working_set_ms: None,
        },
        LazyLaunch {
            prefetch: false,
            record_working_set_ms: Some(250),
        },
    ] {
        let mut launch = VmmLaunch::restore(RestoreLaunch {
            snapshot: "/snap dir/1".into(),
            lazy: Some(lazy),
            overrides: overrides(),
        });
        launch.api_sock = Some("/run/c/api.sock".into());
        launch.jail = Some(JailLaunch::new("/jails/c", 65534, 65534));
        round_trip(launch);
    }
    let mut stdout = RestoreLaunch::new("/snap");
    stdout.overrides.serial = Some(SerialOutput::Stdout);
    stdout.overrides.vsock_cid = Some(5);
    round_trip(VmmLaunch::restore(stdout));
}

#[test]
fn prewarm_round_trips() {
    let mut launch = VmmLaunch::new(LaunchMode::Prewarm(PrewarmLaunch {
        mem_mib: 64,
        vcpus: 1,
        overrides: SnapshotOverrides::default(),
    }));
    launch.api_sock = Some("/run/p/api.sock".into());
    launch.metrics_json = Some("/run/p/metrics.json".into());
    round_trip(launch.clone());
    launch.mode = LaunchMode::Prewarm(PrewarmLaunch {
        mem_mib: 256,
        vcpus: 2,
        overrides: overrides(),
    });
    launch.jail = Some(jail());
    round_trip(launch);
}

#[test]
fn hand_written_command_lines_parse() {
    let l = VmmLaunch::parse_from([
        "dsec-vmm",
        "--kernel",
        "/k",
        "--vsock-uds",
        "/v",
        "--balloon",
        "--serial-stdout",
    ])
    .unwrap();
    let LaunchMode::Boot(c) = l.mode else {
        panic!("{l:?}")
    };
    assert_eq!(c.vsock.unwrap().guest_cid, MIN_GUEST_CID);
    assert_eq!(c.balloon, Some(BalloonConfig::default()));
    assert_eq!(c.serial, SerialOutput::Stdout);
    let l = VmmLaunch::parse_from(["dsec-vmm", "--prewarm", "--api-sock", "/a"]).unwrap();
    assert_eq!(
        l.mode,
        LaunchMode::Prewarm(PrewarmLaunch {
            mem_mib: 256,
            vcpus: 1,
            overrides: SnapshotOverrides::default()
        })
    );
}

#[test]
fn bad_command_lines_are_refused() {
    let err = VmmLaunch::parse_from(["dsec-vmm", "--vcpus", "2"]).unwrap_err();
    assert!(err.to_string().contains("--kernel PATH"), "{err}");
    for argv in [
        &["dsec-vmm", "--restore", "/s", "--kernel", "/k"][..],
        &["dsec-vmm", "--prewarm"],
        &["dsec-vmm", "--kernel", "/k", "--paused"],
        &["dsec-vmm", "--kernel", "/k", "--jail-uid", "5"],
        &["dsec-vmm", "--kernel", "/k", "--drive", "/x,rx"],
    ] {
        assert!(
            matches!(VmmLaunch::parse_from(argv), Err(LaunchError::Usage(_))),
            "{argv:?}"
        );
    }
}
