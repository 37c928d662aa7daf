//! Marks the tests that need what a fresh clone lacks as ignored where it is missing (see the
//! test-gates crate): they are counted as ignored, with the reason, never as passed.

fn main() {
    test_gates::gate(&[test_gates::API_SERVER, test_gates::CONTROL_PLANE]);
}
