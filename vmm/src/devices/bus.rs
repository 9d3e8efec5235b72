//! Port-IO and MMIO buses: address ranges mapped to devices.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::sync::lock;

/// A device reachable through guest port or memory accesses. Offsets are relative to the
/// device's base; `data` is the access width (1, 2, 4 or 8 bytes), guest-controlled.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// A shared device handle.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Debug, thiserror::Error)]
#[error("bus range {base:#x}+{len:#x} overlaps a device already registered")]
pub struct BusOverlap {
    pub base: u64,
    pub len: u64,
}

/// Sorted, non-overlapping ranges.
#[derive(Default, Clone)]
pub struct Bus {
    ranges: BTreeMap<u64, (u64, SharedDevice)>,
}

impl Bus {
    pub fn insert(&mut self, base: u64, len: u64, device: SharedDevice) -> Result<(), BusOverlap> {
        let end = base.checked_add(len).ok_or(BusOverlap { base, len })?;
        let overlaps_prev = self
            .ranges
            .range(..end)
            .next_back()
            .is_some_and(|(&b, &(l, _))| b + l > base);
        if len == 0 || overlaps_prev {
            return Err(BusOverlap { base, len });
        }
        self.ranges.insert(base, (len, device));
        Ok(())
    }

    fn find(&self, addr: u64, width: usize) -> Option<(u64, &SharedDevice)> {
        let (&base, (len, device)) = self.ranges.range(..=addr).next_back()?;
        let offset = addr - base;
        // The whole access must fall inside the device's range.
        (offset + width as u64 <= *len).then_some((offset, device))
    }

    /// Returns false when nothing is mapped there (the caller decides what the guest sees).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((offset, device)) => {
                lock(device).read(offset, data);
                true
            }
            None => false,
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((offset, device)) => {
                lock(device).write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(u8);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(self.0 + offset as u8);
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0 = data[0];
        }
    }

    #[test]
    fn lookup_and_bounds() {
        let mut bus = Bus::default();
        bus.insert(0x10, 4, Arc::new(Mutex::new(Echo(1)))).unwrap();
        assert!(bus.insert(0x12, 4, Arc::new(Mutex::new(Echo(0)))).is_err());
        assert!(bus.insert(0x0e, 4, Arc::new(Mutex::new(Echo(0)))).is_err());
        assert!(bus
            .insert(u64::MAX, 4, Arc::new(Mutex::new(Echo(0))))
            .is_err());
        bus.insert(0x14, 4, Arc::new(Mutex::new(Echo(9)))).unwrap();
        let mut b = [0u8; 1];
        assert!(bus.read(0x11, &mut b));
        assert_eq!(b[0], 2);
        // A 4-byte access at offset 2 would run past the device: refused.
        let mut w = [0u8; 4];
        assert!(!bus.read(0x12, &mut w));
        assert!(!bus.read(0x100, &mut b));
        assert!(bus.write(0x15, &[7]));
        assert!(bus.read(0x14, &mut b));
        assert_eq!(b[0], 7);
    }
}
