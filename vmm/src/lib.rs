//! DSec VMM library.
