//! Announces itself, then executes `ud2`: with no IDT the CPU triple-faults and the VMM must
//! report the crash (exit status 3).
#![no_std]
#![no_main]

use dsec_test_guests::{crash, println};

#[no_mangle]
pub extern "C" fn main(_boot_info: u64, _boot_kind: u64) -> ! {
    println!("about to triple fault");
    crash()
}
