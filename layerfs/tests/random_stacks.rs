//! Randomized conformance: many generated layer stacks (files, dirs, symlinks, hard links,
//! whiteouts, opaque dirs, same-layer whiteout + entry) must look the same through the
//! layerfs FUSE view as through kernel overlayfs over the same layers.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::sync::Arc;

use common::{can_mount, diff, snapshot, snapshot_opts, Env, MountGuard, Tar};
use dsec_layerfs::{fuse, overlay, Digest};

const PATHS: &[&str] = &["a", "b", "d", "d/a", "d/b", "d/e", "d/e/a", "d/e/b", "f"];

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Clone, Copy, PartialEq)]
enum K {
    Dir,
    File,
    Other,
}

fn parent(p: &str) -> Option<&str> {
    p.rsplit_once('/').map(|(d, _)| d)
}

/// One random layer: every path at most once (plus whiteouts), parents always explicit.
fn random_layer(rng: &mut Rng, layer: usize) -> Vec<u8> {
    let mut t = Tar::new();
    let mut have: BTreeMap<String, K> = BTreeMap::new();
    let mut whiteouts = Vec::new();
    fn ensure_dirs(t: Tar, have: &mut BTreeMap<String, K>, p: &str) -> Option<Tar> {
        let mut t = t;
        let mut cur = String::new();
        let comps: Vec<&str> = p.split('/').collect();
        for c in &comps[..comps.len() - 1] {
            cur = if cur.is_empty() {
                c.to_string()
            } else {
                format!("{cur}/{c}")
            };
            match have.get(&cur) {
                Some(K::Dir) => {}
                Some(_) => return None,
                None => {
                    t = t.dir(&cur, 0o755);
                    have.insert(cur.clone(), K::Dir);
                }
            }
        }
        Some(t)
    }
    for _ in 0..(3 + rng.below(8)) {
        let p = PATHS[rng.below(PATHS.len())];
        let op = rng.below(7);
        let mut blocked = false;
        let mut anc = parent(p);
        while let Some(a) = anc {
            blocked |= have.get(a).is_some_and(|k| *k != K::Dir);
            anc = parent(a);
        }
        if blocked || (have.contains_key(p) && op != 4) {
            continue;
        }
        let Some(nt) = ensure_dirs(std::mem::take(&mut t), &mut have, p) else {
            unreachable!()
        };
        t = nt;
        match op {
            0 | 1 => {
                t = t.file_owned(
                    p,
                    format!("{p} in layer {layer} #{}", rng.next() % 1000).as_bytes(),
                    0o644 + (op as u32),
                    0,
                    0,
                );
                have.insert(p.into(), K::File);
            }
            2 => {
                t = t.dir(p, 0o700 + rng.below(2) as u32 * 0o55);
                have.insert(p.into(), K::Dir);
            }
            3 => {
                t = t.symlink(p, &format!("target-{}", rng.below(3)));
                have.insert(p.into(), K::Other);
            }
            4 => {
                // Whiteout (possibly next to this layer's own entry at the same path).
                if !whiteouts.contains(&p) {
                    let (d, n) = p.rsplit_once('/').unwrap_or(("", p));
                    t = t.whiteout(d, n);
                    whiteouts.push(p);
                }
            }
            5 => {
                t = t.dir(p, 0o755).opaque(p);
                have.insert(p.into(), K::Dir);
            }
            _ => {
                let files: Vec<String> = have
                    .iter()
                    .filter(|(_, k)| **k == K::File)
                    .map(|(p, _)| p.clone())
                    .collect();
                if files.is_empty() {
                    continue;
                }
                let target = files[rng.below(files.len())].clone();
                t = t.hardlink(p, &target);
                have.insert(p.into(), K::File);
            }
        }
    }
    t.bytes()
}

#[test]
fn random_stacks_match_overlayfs() {
    if !can_mount() {
        return;
    }
    let env = Env::new();
    let mut rng = Rng(0x5eed_1234_abcd_ef01);
    let mut compared = 0;
    for case in 0..60 {
        let n = 2 + rng.below(3);
        let mut ids: Vec<Digest> = Vec::new();
        for l in 0..n {
            let tar = random_layer(&mut rng, l);
            match dsec_layerfs::tarfmt::import_tar(&env.store, &tar[..]) {
                Ok(imp) => ids.push(imp.layer),
                Err(e) => panic!("case {case}: generated layer rejected: {e}"),
            }
        }
        let dir = env.path(&format!("case{case}"));
        fs::create_dir(&dir).unwrap();
        let mut lowers = Vec::new();
        for (i, id) in ids.iter().enumerate() {
            let p = dir.join(format!("l{i}"));
            overlay::export_overlay_dir(&env.cache, &env.cache.layer(id).unwrap(), &p).unwrap();
            lowers.push(p);
        }
        let ovl = dir.join("ovl");
        let mnt = dir.join("fuse");
        fs::create_dir(&ovl).unwrap();
        fs::create_dir(&mnt).unwrap();
        let top_first: Vec<&std::path::Path> = lowers.iter().rev().map(|p| p.as_path()).collect();
        overlay::mount_overlay(&top_first, None, &ovl).unwrap();
        let _g1 = MountGuard(ovl.clone());
        let m = fuse::mount(
            Arc::new(env.cache.compose(&ids).unwrap()),
            env.cache.clone(),
            &mnt,
            false,
        )
        .unwrap();
        let _g2 = MountGuard(mnt.clone());
        let mut ours = snapshot(&mnt);
        let mut theirs = snapshot_opts(&ovl, true);
        // st_nlink of hard links whose sibling a later layer replaced differs on purpose
        // (see README); everything else must match.
        for r in ours.values_mut().chain(theirs.values_mut()) {
            r.nlink = 0;
        }
        let d = diff(&ours, &theirs, "layerfs", "overlayfs");
        assert_eq!(d, 0, "case {case}: merged trees differ");
        compared += ours.len();
        m.unmount();
    }
    assert!(
        compared > 100,
        "generator too weak: {compared} entries compared"
    );
}
