//! The annotated example in `docs/config.md` must stay a valid config.

use std::path::Path;

#[test]
fn documented_example_is_valid_and_resolves() {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/config.md"))
        .unwrap();
    let start = doc.find("```toml\n").expect("a TOML example") + "```toml\n".len();
    let end = start + doc[start..].find("```").expect("closed block");
    let loaded = ferrozero_config::parse(
        &doc[start..end],
        ferrozero_config::Format::Toml,
        "docs/config.md",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let ctx = ferrozero_config::ResolveContext {
        world_size: 4,
        hidden_size: Some(4096),
        micro_batch_hint: None,
    };
    let r = loaded
        .config
        .resolve(&ctx)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.train_batch_size, 64);
}
