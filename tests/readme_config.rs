//! The annotated config in README.md loads and resolves, so the documentation cannot rot.

use ferrozero::config::{parse, Format, ResolveContext};

#[test]
fn readme_example_config_is_valid() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let start = readme.find("```toml\n").expect("README has a toml block") + "```toml\n".len();
    let end = start + readme[start..].find("```").unwrap();
    let loaded =
        parse(&readme[start..end], Format::Toml, "README.md").unwrap_or_else(|e| panic!("{e}"));
    let ctx = ResolveContext {
        world_size: 8,
        hidden_size: Some(4096),
        micro_batch_hint: None,
    };
    let r = loaded
        .config
        .resolve(&ctx)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(r.train_batch_size, 4 * 8 * 8);
    assert_eq!(r.zero.reduce_bucket_size, 4096 * 4096);
}
