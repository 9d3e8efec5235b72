//! The installed Debian image (`images/debian/build.sh --install`, run by setup.sh) on the
//! container backend: its tools run, and writes stay in the sandbox's upper layer.
//! Run as root: `cargo test -p dsec-edge --test debian_image`.

mod common;

use std::path::PathBuf;

use common::TestNode;
use dsec_edge::{Artifacts, BackendKind, ExecSpec, Sandbox, SandboxSpec};

/// The installed image's root directory; a missing image fails with the command to run.
fn debian_rootfs() -> PathBuf {
    let image = Artifacts::from_env().image("debian");
    image
        .check("debian", BackendKind::Container)
        .unwrap_or_else(|e| panic!("{e}"));
    image.rootfs
}

async fn run(sandbox: &Sandbox, argv: &[&str]) -> (i32, String, String) {
    let out = sandbox
        .agent()
        .exec_collect(&ExecSpec::new(argv.iter().copied()), None)
        .await
        .expect("exec");
    (
        out.outcome.exit_code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn python_bash_and_git_run_and_writes_stay_in_the_upper_layer() {
    let rootfs = debian_rootfs();
    let node = TestNode::new("debian");
    let spec = SandboxSpec {
        rootfs: Some(rootfs.clone()),
        ..SandboxSpec::default()
    };
    let sandbox = Sandbox::create(BackendKind::Container, &node.config, &spec)
        .await
        .expect("create a container of the debian image");

    let (code, out, err) = run(&sandbox, &["python3", "-c", "print(6*7)"]).await;
    assert_eq!((code, out.as_str()), (0, "42\n"), "stderr: {err}");
    let (code, out, err) = run(
        &sandbox,
        &["bash", "-c", "echo ${BASH_VERSION%%.*}; exit 3"],
    )
    .await;
    assert_eq!(code, 3, "stderr: {err}");
    assert!(out.trim().parse::<u32>().unwrap_or(0) >= 5, "bash: {out}");
    let (code, out, err) = run(&sandbox, &["git", "--version"]).await;
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.starts_with("git version 2."), "{out}");
    let (_, out, _) = run(&sandbox, &["grep", "-x", "ID=debian", "/etc/os-release"]).await;
    assert_eq!(out, "ID=debian\n");

    // A git repository, an edit of an image file and a deletion: all inside only.
    let (code, _, err) = run(
        &sandbox,
        &[
            "bash",
            "-c",
            "set -e; mkdir /project && cd /project && git init -q && echo hi > f && git add f \
             && git -c user.name=t -c user.email=t@t commit -qm one \
             && echo edited >> /etc/debian_version && rm /usr/bin/python3",
        ],
    )
    .await;
    assert_eq!(code, 0, "stderr: {err}");
    let upper = sandbox.dir().join("layers/disk/upper");
    assert!(
        upper.join("project/.git/HEAD").is_file(),
        "repo not in {}",
        upper.display()
    );
    // Written by sandbox root: stored as its host uid (the first of the sandbox's range),
    // never as host root.
    use std::os::unix::fs::MetadataExt;
    let range = dsec_edge::idpool::recorded(sandbox.dir()).expect("the sandbox's id range");
    let head = std::fs::metadata(upper.join("project/.git/HEAD")).unwrap();
    assert_eq!((head.uid(), head.gid()), (range.base, range.base));
    assert!(upper.join("etc/debian_version").is_file());
    assert!(!rootfs.join("project").exists(), "write reached the image");
    let version = std::fs::read_to_string(rootfs.join("etc/debian_version")).unwrap();
    assert!(
        !version.contains("edited"),
        "image file modified: {version}"
    );
    assert!(
        rootfs.join("usr/bin/python3").exists(),
        "deletion reached the image"
    );
    let (code, _, _) = run(&sandbox, &["test", "-e", "/usr/bin/python3"]).await;
    assert_eq!(code, 1, "the deletion must be visible inside");
    let (_, out, _) = run(&sandbox, &["git", "-C", "/project", "log", "--format=%s"]).await;
    assert_eq!(out, "one\n");

    let dir = sandbox.dir().to_path_buf();
    sandbox.destroy().await.unwrap();
    assert!(
        !dir.exists(),
        "upper layer left behind at {}",
        dir.display()
    );
    assert!(node.leftovers().is_empty());
}

#[tokio::test]
async fn a_missing_image_names_the_command_that_builds_it() {
    let home = std::env::temp_dir().join(format!("dsec-test-{}-noimage", std::process::id()));
    let image = Artifacts::under(&home).image("debian");
    for kind in [BackendKind::Container, BackendKind::MicroVm] {
        let err = image.check("debian", kind).unwrap_err().to_string();
        assert!(err.contains("images/debian/build.sh --install"), "{err}");
        assert!(err.contains(&home.display().to_string()), "{err}");
        assert!(err.contains(kind.as_str()), "{err}");
    }
    let err = Artifacts::under(&home)
        .image("other")
        .check("other", BackendKind::Container)
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"other\" is not installed"), "{err}");
    assert!(err.contains("./setup.sh"), "{err}");
}
