//! A Hugging Face checkpoint folder: `config.json`, the optional
//! `generation_config.json`, and the weights in `model.safetensors` or in shards
//! listed by `model.safetensors.index.json`. Each weight file is memory-mapped and
//! only its header parsed: tensors are views into the mapping, so opening a
//! checkpoint costs no copy of the weights.

use super::chat::ChatTemplate;
use super::config::{GenerationConfig, ModelConfig};
use super::tokenizer::Tokenizer;
use crate::error::{Error, Result};
use crate::layer::weights::layer_tensors;
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorView};
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// The single-file weights.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of sharded weights: `{"weight_map": {tensor: file}}`.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor the model needs: its Hugging Face name and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedTensor {
    pub name: String,
    pub shape: Vec<usize>,
}

/// Every tensor of the model, in file order: embeddings, the layers, the final norm,
/// and `lm_head.weight` unless the embeddings are tied.
pub fn expected_tensors(c: &ModelConfig) -> Vec<ExpectedTensor> {
    let t = |name: String, shape: &[usize]| ExpectedTensor { name, shape: shape.to_vec() };
    let (d, v) = (c.hidden_size, c.vocab_size);
    let lc = c.layer_config();
    let mut all = vec![t("model.embed_tokens.weight".into(), &[v, d])];
    for layer in 0..c.num_hidden_layers {
        for (name, shape) in layer_tensors(&lc, layer) {
            all.push(t(name, &shape));
        }
        if c.attention_bias {
            for (proj, n) in [("q", c.q_dim()), ("k", c.kv_dim()), ("v", c.kv_dim())] {
                all.push(t(format!("model.layers.{layer}.self_attn.{proj}_proj.bias"), &[n]));
            }
        }
    }
    all.push(t("model.norm.weight".into(), &[d]));
    if !c.tie_word_embeddings {
        all.push(t("lm_head.weight".into(), &[v, d]));
    }
    all
}

/// The element types a weight may be stored in: bf16 is used as it is, f16 and f32
/// are converted on load.
pub fn supported_dtype(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32)
}

/// Checks a tensor's shape and element type; the error names the tensor and both shapes.
pub(crate) fn check_view(name: &str, t: &TensorView, shape: &[usize]) -> Result<()> {
    if t.shape() != shape {
        return Err(Error::Shape(format!(
            "`{name}`: shape {:?} in the checkpoint, the config needs {shape:?}",
            t.shape()
        )));
    }
    if !supported_dtype(t.dtype()) {
        return Err(Error::DType(format!("`{name}`: dtype {:?} is not supported (bf16, f16, f32)", t.dtype())));
    }
    Ok(())
}

/// One memory-mapped safetensors file and its parsed header.
struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Where the tensor data starts: after the 8-byte length and the header.
    data_start: usize,
    metadata: Metadata,
}

impl Shard {
    fn open(path: PathBuf) -> Result<Self> {
        let io = |e: std::io::Error| Error::Checkpoint(format!("{}: {e}", path.display()));
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the mapping is read-only and private to this process; it stays sound
        // as long as no one truncates or rewrites the file while it is open (see SAFETY.md).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let (header, metadata) = SafeTensors::read_metadata(&map)
            .map_err(|e| Error::Checkpoint(format!("{}: safetensors header: {e}", path.display())))?;
        Ok(Shard { path, map, data_start: 8 + header, metadata })
    }

    fn tensor(&self, name: &str) -> Option<Result<TensorView<'_>>> {
        let info = self.metadata.info(name)?;
        let (start, end) = info.data_offsets;
        // `read_metadata` checked that the offsets tile the data exactly.
        let bytes = &self.map[self.data_start + start..self.data_start + end];
        Some(
            TensorView::new(info.dtype, info.shape.clone(), bytes)
                .map_err(|e| Error::Checkpoint(format!("`{name}` in {}: {e}", self.path.display()))),
        )
    }
}

/// An open checkpoint folder.
pub struct Checkpoint {
    dir: PathBuf,
    config: ModelConfig,
    generation: Option<GenerationConfig>,
    shards: Vec<Shard>,
    /// Tensor name → index into `shards`.
    index: HashMap<String, usize>,
}

impl Checkpoint {
    /// Reads and checks the configuration, maps the weight files and parses their
    /// headers. Tensors are checked against the configuration by [`validate`](Self::validate).
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let generation_path = dir.join("generation_config.json");
        let generation = match std::fs::read_to_string(&generation_path) {
            Ok(text) => Some(GenerationConfig::from_json(&text)?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::Checkpoint(format!("{}: {e}", generation_path.display()))),
        };
        let (shards, index) = if dir.join(INDEX_FILE).exists() {
            Self::open_sharded(&dir)?
        } else if dir.join(WEIGHTS_FILE).exists() {
            let shard = Shard::open(dir.join(WEIGHTS_FILE))?;
            let index = shard.metadata.offset_keys().into_iter().map(|name| (name, 0)).collect();
            (vec![shard], index)
        } else {
            return Err(Error::Checkpoint(format!("{}: neither {WEIGHTS_FILE} nor {INDEX_FILE}", dir.display())));
        };
        Ok(Checkpoint { dir, config, generation, shards, index })
    }

    fn open_sharded(dir: &Path) -> Result<(Vec<Shard>, HashMap<String, usize>)> {
        let path = dir.join(INDEX_FILE);
        let bad = |m: String| Error::Checkpoint(format!("{INDEX_FILE}: {m}"));
        let text = std::fs::read_to_string(&path).map_err(|e| bad(e.to_string()))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("no `weight_map`".into()))?;
        let mut files: BTreeSet<&str> = BTreeSet::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| bad(format!("`weight_map.{name}` is not a file name")))?;
            // A shard is a file in this folder, never a path out of it.
            if file.contains(['/', '\\']) || file == ".." {
                return Err(bad(format!("`weight_map.{name}`: `{file}` is not a file of this folder")));
            }
            files.insert(file);
        }
        let files: Vec<&str> = files.into_iter().collect();
        let shards = files.iter().map(|f| Shard::open(dir.join(f))).collect::<Result<Vec<_>>>()?;
        let mut index = HashMap::with_capacity(map.len());
        for (name, file) in map {
            let file = file.as_str().unwrap_or_default();
            let i = files.binary_search(&file).unwrap_or_default();
            if shards[i].metadata.info(name).is_none() {
                return Err(bad(format!("`{name}` is mapped to {file}, which does not hold it")));
            }
            index.insert(name.clone(), i);
        }
        Ok((shards, index))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The contents of `generation_config.json`, where the folder has one.
    pub fn generation_config(&self) -> Option<&GenerationConfig> {
        self.generation.as_ref()
    }

    /// The weight files, in the order of their names.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    /// Every tensor name the weight files hold (or the index maps), in no order.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// A view of a tensor's bytes in the mapped file, with its dtype and shape.
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let missing = || Error::Checkpoint(format!("tensor `{name}` is not in the checkpoint"));
        let shard = &self.shards[*self.index.get(name).ok_or_else(missing)?];
        shard.tensor(name).ok_or_else(missing)?
    }

    /// [`tensor`](Self::tensor), checked to have `shape` and a supported dtype.
    pub fn tensor_checked(&self, name: &str, shape: &[usize]) -> Result<TensorView<'_>> {
        let t = self.tensor(name)?;
        check_view(name, &t, shape)?;
        Ok(t)
    }

    /// The folder's `tokenizer.json`, parsed on each call.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        Tokenizer::from_file(&self.dir.join("tokenizer.json"))
    }

    /// The folder's chat template, read on each call: `chat_template.jinja` where the
    /// folder has one (newer `transformers` save the template there, and it takes
    /// precedence), else `tokenizer_config.json`'s `chat_template`; the special
    /// tokens come from `tokenizer_config.json`. `None` when neither has a template.
    pub fn chat_template(&self) -> Result<Option<ChatTemplate>> {
        let read = |name: &str| match std::fs::read_to_string(self.dir.join(name)) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::Checkpoint(format!("{name}: {e}"))),
        };
        let config = read("tokenizer_config.json")?;
        match read("chat_template.jinja")? {
            Some(source) => {
                let (bos, eos) = match &config {
                    Some(text) => ChatTemplate::special_tokens_of(text)?,
                    None => (None, None),
                };
                ChatTemplate::new(source, bos, eos).map(Some).map_err(|e| match e {
                    Error::Checkpoint(m) => Error::Checkpoint(format!("chat_template.jinja: {m}")),
                    e => e,
                })
            }
            None => config.map_or(Ok(None), |text| ChatTemplate::from_tokenizer_config(&text)),
        }
    }

    /// The name of the output projection: `lm_head.weight`, or the embeddings when tied.
    pub fn lm_head_name(&self) -> &'static str {
        if self.config.tie_word_embeddings {
            "model.embed_tokens.weight"
        } else {
            "lm_head.weight"
        }
    }

    /// Checks that every tensor the configuration implies is present with its shape
    /// and a supported dtype, and reports the first that is not.
    pub fn validate(&self) -> Result<()> {
        for t in expected_tensors(&self.config) {
            self.tensor_checked(&t.name, &t.shape)?;
        }
        Ok(())
    }
}
