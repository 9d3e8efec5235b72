//! Prints a known text over the UART and resets. The test compares the log byte for byte.
#![no_std]
#![no_main]

use dsec_test_guests::{print, println, reset};

#[no_mangle]
pub extern "C" fn main(_boot_info: u64, boot_kind: u64) -> ! {
    println!("dsec test guest: serial");
    println!("line 2: the quick brown fox jumps over the lazy dog 0123456789");
    print!("line 3: no newline yet...");
    println!(" done");
    println!("boot kind {}", boot_kind);
    println!("DONE 0 0");
    reset()
}
