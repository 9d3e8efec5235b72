//! Bad requests fail before anything starts, with messages that name the problem.

mod common;

use std::path::PathBuf;

use common::TestNode;
use dsec_edge::{parse_env, BackendKind, EdgeError, Sandbox, SandboxSpec};

async fn create_err(node: &TestNode, kind: BackendKind, spec: SandboxSpec) -> EdgeError {
    Sandbox::create(kind, &node.config, &spec)
        .await
        .unwrap_err()
}

#[tokio::test]
async fn bad_specs_are_named() {
    let node = TestNode::new("errors");
    let spec = SandboxSpec {
        vcpus: 0,
        ..node.spec()
    };
    let err = create_err(&node, BackendKind::Container, spec).await;
    assert!(
        err.to_string().contains("vcpus must be at least 1"),
        "{err}"
    );

    let spec = SandboxSpec {
        mem_mib: u32::MAX,
        ..node.spec()
    };
    let err = create_err(&node, BackendKind::MicroVm, spec).await;
    assert!(err.to_string().contains("more than this host has"), "{err}");

    let spec = SandboxSpec {
        kernel: Some(PathBuf::from("/nonexistent/vmlinux")),
        ..node.spec()
    };
    let err = create_err(&node, BackendKind::MicroVm, spec).await;
    assert!(
        err.to_string()
            .contains("guest kernel not found at /nonexistent/vmlinux"),
        "{err}"
    );

    // A microVM's root disk is checked before anything starts (kernel and initramfs exist).
    let kernel = node.rootfs.join("bin/busybox");
    let initrd = node.rootfs.parent().unwrap().join("initramfs.cpio");
    let spec = SandboxSpec {
        kernel: Some(kernel.clone()),
        initrd: Some(initrd.clone()),
        root_disk: Some(PathBuf::from("/nonexistent/rootfs.img")),
        ..node.spec()
    };
    let err = create_err(&node, BackendKind::MicroVm, spec)
        .await
        .to_string();
    assert!(
        err.contains("root disk image not found at /nonexistent/rootfs.img")
            && err.contains("images/debian/build.sh --install"),
        "{err}"
    );
    let comma = node.config.state_dir.with_extension("a,b.img");
    std::fs::write(&comma, b"").unwrap();
    let spec = SandboxSpec {
        kernel: Some(kernel),
        initrd: Some(initrd),
        root_disk: Some(comma.clone()),
        ..node.spec()
    };
    let err = create_err(&node, BackendKind::MicroVm, spec)
        .await
        .to_string();
    std::fs::remove_file(&comma).unwrap();
    assert!(err.contains("contains ','"), "{err}");

    let spec = SandboxSpec {
        rootfs: Some(PathBuf::from("/nonexistent/rootfs")),
        ..node.spec()
    };
    let err = create_err(&node, BackendKind::Container, spec).await;
    assert!(
        err.to_string()
            .contains("container root filesystem not found at /nonexistent/rootfs"),
        "{err}"
    );
    assert!(node.leftovers().is_empty());
}

#[test]
fn env_pairs_are_checked() {
    assert_eq!(parse_env(&["A=b=c".into()]).unwrap()["A"], "b=c");
    assert_eq!(parse_env(&["EMPTY=".into()]).unwrap()["EMPTY"], "");
    for bad in ["NOEQUALS", "=value"] {
        let err = parse_env(&[bad.into()]).unwrap_err();
        assert!(err.to_string().contains("expected KEY=VALUE"), "{err}");
    }
}
