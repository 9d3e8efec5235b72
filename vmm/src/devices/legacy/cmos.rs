//! Minimal MC146818 RTC/CMOS: answers with a valid, idle clock so the guest never spins
//! waiting for "update in progress" to clear (each poll is a VM exit).

use crate::devices::bus::BusDevice;

const REG_STATUS_A: u8 = 0x0a;
const REG_STATUS_B: u8 = 0x0b;
const REG_STATUS_D: u8 = 0x0d;

pub struct Cmos {
    index: u8,
    nvram: [u8; 128],
}

impl Default for Cmos {
    fn default() -> Self {
        Cmos {
            index: 0,
            nvram: [0; 128],
        }
    }
}

impl BusDevice for Cmos {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match (offset, self.index) {
            (0, _) => self.index,
            (_, REG_STATUS_A) => 0x26, // 32 kHz base, 1 kHz rate, UIP clear
            (_, REG_STATUS_B) => 0x02, // 24-hour mode, BCD
            (_, REG_STATUS_D) => 0x80, // RTC battery valid
            (_, index) => self.nvram[usize::from(index & 0x7f)],
        };
        data.fill(0);
        data[0] = value;
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&value) = data.first() else { return };
        if offset == 0 {
            // Bit 7 is the NMI mask, not part of the index.
            self.index = value & 0x7f;
        } else {
            self.nvram[usize::from(self.index)] = value;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn update_in_progress_is_clear_and_index_is_bounded() {
        let mut cmos = Cmos::default();
        cmos.write(0, &[0x8a]);
        let mut b = [0xffu8];
        cmos.read(1, &mut b);
        assert_eq!(b[0] & 0x80, 0);
        cmos.write(0, &[0xff]);
        cmos.write(1, &[5]);
        cmos.read(1, &mut b);
        assert_eq!(b[0], 5);
    }
}
