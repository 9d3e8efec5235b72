//! The dsec-layerfs binary end to end: import, ls, inspect, mount (SIGTERM unmounts and
//! saves the hot list), rm, gc.

mod common;

use std::fs;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{can_mount, MountGuard, Tar};

struct Cli {
    dir: tempfile::TempDir,
}

impl Cli {
    fn cmd(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_dsec-layerfs"));
        c.arg("--store")
            .arg(self.dir.path().join("store"))
            .arg("--cache")
            .arg(self.dir.path().join("cache"))
            .arg("--json");
        c
    }
    fn json(&self, args: &[&str]) -> serde_json::Value {
        let out = self.cmd().args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

#[test]
fn import_ls_inspect_mount_rm_gc() {
    let cli = Cli {
        dir: tempfile::tempdir().unwrap(),
    };
    let l0 = cli.dir.path().join("l0.tar");
    let l1 = cli.dir.path().join("l1.tar");
    fs::write(
        &l0,
        Tar::new()
            .dir("etc", 0o755)
            .file("etc/a", b"a")
            .file("etc/b", &vec![3u8; 100_000])
            .bytes(),
    )
    .unwrap();
    fs::write(
        &l1,
        Tar::new().dir("etc", 0o755).whiteout("etc", "a").bytes(),
    )
    .unwrap();
    let imp = cli.json(&[
        "import",
        "--name",
        "demo",
        l0.to_str().unwrap(),
        l1.to_str().unwrap(),
    ]);
    assert_eq!(imp["layers"].as_array().unwrap().len(), 2);
    let ls = cli.json(&["ls"]);
    assert_eq!(ls[0]["name"], "demo");
    let ins = cli.json(&["inspect", "demo"]);
    assert_eq!(ins["layers"][1]["whiteouts"], 1);
    let bad = cli.cmd().args(["inspect", "nope"]).output().unwrap();
    assert!(!bad.status.success());
    let err: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert!(
        err["error"].as_str().unwrap().contains("not found"),
        "{err}"
    );

    if can_mount() {
        let mnt = cli.dir.path().join("mnt");
        fs::create_dir(&mnt).unwrap();
        let mut child = cli
            .cmd()
            .args(["mount", "demo", mnt.to_str().unwrap(), "--record-hot"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let _g = MountGuard(mnt.clone());
        let deadline = Instant::now() + Duration::from_secs(20);
        while !mnt.join("etc").exists() {
            assert!(Instant::now() < deadline, "mount did not appear");
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(fs::read(mnt.join("etc/b")).unwrap().len(), 100_000);
        assert!(!mnt.join("etc/a").exists());
        // SAFETY: kill on our own child's pid.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        assert!(child.wait().unwrap().success());
        assert!(!mnt.join("etc").exists(), "still mounted after SIGTERM");
        let ins = cli.json(&["inspect", "demo"]);
        assert!(
            ins["image"]["hot_list"].is_string(),
            "hot list not saved: {ins}"
        );
    }

    cli.json(&["rm", "demo"]);
    let gc = cli.json(&["gc", "--grace-secs", "0"]);
    assert_eq!(gc["layers_removed"], 2);
    assert!(gc["chunks_removed"].as_u64().unwrap() >= 2);
    let chunks = cli.dir.path().join("store/chunks");
    let left: usize = fs::read_dir(&chunks)
        .unwrap()
        .map(|d| fs::read_dir(d.unwrap().path()).unwrap().count())
        .sum();
    assert_eq!(left, 0);
}
