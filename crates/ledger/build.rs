//! `sqlx::migrate!` embeds `migrations/` when this crate is compiled, and cargo does not know
//! it reads that directory: without this, a new migration left a crate built before it without
//! it (until some source of the crate changed).
fn main() {
    println!("cargo:rerun-if-changed=../../migrations");
}
