//! The checkpoint's `tokenizer.json`, through the `tokenizers` crate (built with its
//! pure-Rust regex engine, so no C toolchain is needed).

use crate::error::{Error, Result};
use std::path::Path;
use std::str::FromStr;

/// A Hugging Face tokenizer: text to token ids and back.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

fn bad(e: impl std::fmt::Display) -> Error {
    Error::Checkpoint(format!("tokenizer.json: {e}"))
}

impl Tokenizer {
    /// Parses the text of a `tokenizer.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        Ok(Tokenizer { inner: tokenizers::Tokenizer::from_str(text).map_err(bad)? })
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Checkpoint(format!("{}: {e}", path.display())))?;
        Self::from_json(&text)
    }

    /// Token ids of `text`; `add_special_tokens` applies the post-processor (a BOS
    /// token, for Llama).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(self.inner.encode(text, add_special_tokens).map_err(bad)?.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(bad)
    }

    /// The id of a token (special tokens included), if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The number of ids, special tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_level_round_trip() {
        let json = r#"{
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1, "world": 2, "!": 3}, "unk_token": "<unk>"}
        }"#;
        let t = Tokenizer::from_json(json).unwrap();
        let ids = t.encode("hello world !", false).unwrap();
        assert_eq!(ids, vec![1, 2, 3]);
        assert_eq!(t.decode(&ids, false).unwrap(), "hello world !");
        assert_eq!(t.encode("hello moon", false).unwrap(), vec![1, 0]);
        assert_eq!((t.token_id("world"), t.vocab_size()), (Some(2), 4));
        assert!(matches!(Tokenizer::from_json("{}"), Err(Error::Checkpoint(_))));
    }
}
