//! Speculative decoding without a draft model (prompt lookup, as vLLM's
//! n-gram speculator): the next tokens are guessed from the context itself,
//! by the tokens that followed the last earlier occurrence of its final
//! n-gram, and one decode step of several tokens a sequence
//! ([`Model::decode_tokens`]) checks them all ([`GreedyCheck`]). Greedy: a guess is kept while
//! it is the token the model itself picks, so the output is the one plain
//! greedy decoding gives (up to near-ties that the two paths' bf16 rounding
//! may order differently), in fewer steps where text repeats.

use super::Model;
use crate::error::{Error, Result};
use crate::ops::decode::MAX_Q_LEN;
use crate::ops::sampling::{sample, SampleOutput, SamplingParams};
use crate::ops::SeqId;
use crate::runtime::Gpu;
use crate::tensor::Tensor;
use half::bf16;

/// Guesses from the context: the longest final n-gram (`max_ngram` tokens
/// down to 1) that occurred earlier, and up to `drafts` tokens that followed
/// its last such occurrence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLookup {
    pub max_ngram: usize,
    pub drafts: usize,
}

impl PromptLookup {
    /// At most `drafts` guesses a step: a step checks them and the last
    /// accepted token, [`MAX_Q_LEN`] tokens at most.
    pub fn new(max_ngram: usize, drafts: usize) -> Result<PromptLookup> {
        if max_ngram == 0 || drafts == 0 || drafts >= MAX_Q_LEN {
            return Err(Error::InvalidArgument(format!(
                "prompt lookup: n-grams of 1 or more tokens and 1 to {} drafts, not {max_ngram} and {drafts}",
                MAX_Q_LEN - 1
            )));
        }
        Ok(PromptLookup { max_ngram, drafts })
    }

    /// The guesses for what follows `context` (empty when no n-gram recurs).
    pub fn propose<'a>(&self, context: &'a [u32]) -> &'a [u32] {
        for n in (1..=self.max_ngram.min(context.len().saturating_sub(1))).rev() {
            let tail = &context[context.len() - n..];
            // The last earlier occurrence: its end comes before the context's.
            if let Some(start) = (0..context.len() - n).rev().find(|&s| &context[s..s + n] == tail) {
                let from = start + n;
                return &context[from..(from + self.drafts).min(context.len())];
            }
        }
        &[]
    }
}

/// How many of `drafts` a greedy check keeps: the leading ones equal to the
/// model's pick at their position (`picks[i]`, after the last accepted token
/// and `drafts[..i]`).
pub fn accepted(drafts: &[u32], picks: &[u32]) -> usize {
    drafts.iter().zip(picks).take_while(|(d, p)| d == p).count()
}

/// The buffers of greedy checks, one set per tokens-a-step count, kept
/// between steps: a step allocates nothing.
#[derive(Default)]
pub struct GreedyCheck {
    bufs: Vec<Option<(Tensor<bf16>, SampleOutput)>>,
}

impl GreedyCheck {
    pub fn new() -> GreedyCheck {
        GreedyCheck::default()
    }

    /// One greedy speculative step of `seq`: `last`, the token it has not
    /// seen yet, and `drafts` after it, checked in one decode step
    /// ([`Model::decode_tokens`]). Returns the new tokens: the accepted
    /// drafts, then the model's own pick after them (which `seq` has not seen:
    /// the next step's `last`). The rejected drafts' cache rows are cut
    /// ([`Model::truncate`]); on an error, every row the step added.
    pub fn step(&mut self, gpu: &Gpu, model: &mut Model, seq: SeqId, last: u32, drafts: &[u32]) -> Result<Vec<u32>> {
        let k = drafts.len() + 1;
        if k > MAX_Q_LEN {
            return Err(Error::InvalidArgument(format!(
                "speculate: {} drafts, at most {}",
                drafts.len(),
                MAX_Q_LEN - 1
            )));
        }
        if self.bufs.len() < k {
            self.bufs.resize_with(k, || None);
        }
        if self.bufs[k - 1].is_none() {
            let vocab = model.config().vocab_size;
            self.bufs[k - 1] = Some((Tensor::filled(gpu, &[k, vocab], bf16::ZERO)?, SampleOutput::new(gpu, k, false)?));
        }
        let (logits, out) = self.bufs[k - 1].as_mut().expect("made above");
        let before = model.len(seq)?;
        let ids: Vec<u32> = std::iter::once(last).chain(drafts.iter().copied()).collect();
        model.decode_tokens(gpu, &[seq], k, &ids, logits)?;
        let picks = sample(gpu, logits, &vec![SamplingParams::GREEDY; k], out).and_then(|()| out.tokens(gpu));
        let picks = match picks {
            Ok(p) => p,
            Err(err) => {
                model.truncate(gpu, seq, before)?;
                return Err(err);
            }
        };
        let kept = accepted(drafts, &picks);
        // The cache keeps `last` and the accepted drafts; the pick after them is new.
        model.truncate(gpu, seq, before + 1 + kept)?;
        Ok(drafts[..kept].iter().copied().chain(std::iter::once(picks[kept])).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::{accepted, PromptLookup};

    #[test]
    fn lookup_takes_what_followed_the_longest_recurring_tail() {
        let p = PromptLookup::new(3, 4).unwrap();
        // "… 5 6 7 8 9 … 5 6 7": the 3-gram recurs; its follow-up is 8 9 1 2.
        assert_eq!(p.propose(&[1, 5, 6, 7, 8, 9, 1, 2, 5, 6, 7]), &[8, 9, 1, 2]);
        // Only the 1-gram 7 recurs: its last earlier occurrence wins.
        assert_eq!(p.propose(&[7, 1, 7, 2, 3, 7]), &[2, 3, 7]);
        // Nothing recurs, or too little context.
        assert!(p.propose(&[1, 2, 3, 4]).is_empty());
        assert!(p.propose(&[1]).is_empty() && p.propose(&[]).is_empty());
        // A run of one token: the drafts stop at the context's end.
        assert_eq!(p.propose(&[4, 4, 4]), &[4]);
        assert!(PromptLookup::new(3, 8).is_err() && PromptLookup::new(0, 2).is_err());
    }

    #[test]
    fn greedy_check_keeps_the_leading_matches() {
        assert_eq!(accepted(&[3, 4, 5], &[3, 4, 9, 1]), 2);
        assert_eq!(accepted(&[3, 4, 5], &[3, 4, 5, 1]), 3);
        assert_eq!(accepted(&[3, 4, 5], &[8, 4, 5, 1]), 0);
        assert_eq!(accepted(&[], &[8]), 0);
    }
}
