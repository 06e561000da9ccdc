//! Trains the small byte-level BPE tokenizer shipped beside the Shakespeare corpus (what
//! `ferrozero train`'s end-to-end test reads), with the `tokenizers` crate's BPE trainer:
//!
//!     cargo run --release --example train_tokenizer -- data/shakespeare/input.txt \
//!         --vocab 512 -o data/shakespeare/tokenizer.json
//!
//! Training is deterministic: the same corpus and vocabulary give the same file.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerBuilder};

/// Train a byte-level BPE tokenizer on a text file.
#[derive(Parser)]
#[command(name = "train_tokenizer")]
struct Args {
    /// The corpus.
    corpus: PathBuf,
    /// Vocabulary size: the 256 bytes, `<|endoftext|>` and the learned merges.
    #[arg(long, default_value_t = 512)]
    vocab: usize,
    /// Where to write tokenizer.json.
    #[arg(short, long)]
    output: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match train(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn train(args: &Args) -> tokenizers::Result<()> {
    // GPT-2's byte-level setup: no prefix space, so a text cut at blank lines tokenizes as
    // the whole does (the data path tokenizes a .txt file by paragraphs in parallel).
    let byte_level = ByteLevel::new(false, true, true);
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(args.vocab)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .build();
    let mut tokenizer = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None::<NFC>)
        .with_pre_tokenizer(Some(byte_level))
        .with_post_processor(Some(byte_level))
        .with_decoder(Some(byte_level))
        .build()?;
    let corpus = args.corpus.to_string_lossy().into_owned();
    tokenizer
        .train_from_files(&mut trainer, vec![corpus])?
        .save(&args.output, true)?;
    println!(
        "wrote {} ({} tokens)",
        args.output.display(),
        tokenizer.get_vocab_size(true)
    );
    Ok(())
}
