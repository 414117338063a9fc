//! CPU checks of checkpoint loading: each test writes a tiny Hugging Face checkpoint
//! folder (config, seeded bf16 weights, one file or shards) and opens it; the
//! tokenizer and chat template tests add their files to one.

use host::bf16;
use host::data::{cast, random_with_outliers};
use host::layer::{LayerConfig, LayerWeights};
use host::model::{expected_tensors, Checkpoint, Dtype, Message, ModelConfig, ModelType, RopeScaling, WeightDType};
use host::tp::ShardPlan;
use host::Error;
use lab::testing::checkpoint::TempDir;
use safetensors::tensor::TensorView;
use serde_json::{json, Value};
use std::path::Path;

/// hidden 128, 2 layers, 2 heads over 1 KV head of 64, FFN 256, vocab 300.
fn tiny_config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 300,
        "max_position_embeddings": 1024, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    })
}

fn with(mut config: Value, key: &str, value: Value) -> Value {
    config[key] = value;
    config
}

/// One tensor to write: name, shape, dtype, little-endian bytes.
struct Tensor {
    name: String,
    shape: Vec<usize>,
    dtype: Dtype,
    bytes: Vec<u8>,
}

/// Seeded bf16 tensors for everything `config` implies.
fn tensors_for(config: &Value) -> Vec<Tensor> {
    let c = ModelConfig::from_json(&config.to_string()).unwrap();
    expected_tensors(&c)
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let values: Vec<bf16> = cast(&random_with_outliers(100 + i as u64, t.shape.iter().product(), 0.02));
            let bytes = values.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
            Tensor { name: t.name, shape: t.shape, dtype: Dtype::BF16, bytes }
        })
        .collect()
}

fn serialize(tensors: &[&Tensor]) -> Vec<u8> {
    let views = tensors.iter().map(|t| (t.name.clone(), TensorView::new(t.dtype, t.shape.clone(), &t.bytes).unwrap()));
    safetensors::serialize(views, None).unwrap()
}

/// Writes `config.json` and the tensors: one `model.safetensors` when `shards` is 1,
/// otherwise that many shards and an index.
fn write_checkpoint(dir: &Path, config: &Value, tensors: &[Tensor], shards: usize) {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(config).unwrap()).unwrap();
    if shards == 1 {
        std::fs::write(dir.join("model.safetensors"), serialize(&tensors.iter().collect::<Vec<_>>())).unwrap();
        return;
    }
    let per = tensors.len().div_ceil(shards);
    let mut weight_map = serde_json::Map::new();
    for (s, chunk) in tensors.chunks(per).enumerate() {
        let file = format!("model-{:05}-of-{shards:05}.safetensors", s + 1);
        std::fs::write(dir.join(&file), serialize(&chunk.iter().collect::<Vec<_>>())).unwrap();
        for t in chunk {
            weight_map.insert(t.name.clone(), json!(file));
        }
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

fn bf16s(t: &Tensor) -> Vec<bf16> {
    t.bytes.chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect()
}

fn find<'a>(tensors: &'a [Tensor], name: &str) -> &'a Tensor {
    tensors.iter().find(|t| t.name == name).unwrap()
}

/// Opens and validates; the error's message, for checks that it names what is wrong.
fn open_error(config: &Value, tensors: &[Tensor]) -> (Error, String) {
    let dir = TempDir::new("checkpoint-error");
    write_checkpoint(&dir.0, config, tensors, 1);
    let e = Checkpoint::open(&dir.0).and_then(|c| c.validate()).unwrap_err();
    let m = e.to_string();
    (e, m)
}

#[test]
fn single_file_loads_and_validates() {
    let dir = TempDir::new("checkpoint-single");
    let config = tiny_config();
    let tensors = tensors_for(&config);
    write_checkpoint(&dir.0, &config, &tensors, 1);
    std::fs::write(dir.0.join("generation_config.json"), r#"{"bos_token_id": 1, "eos_token_id": [2, 3]}"#).unwrap();

    let ckpt = Checkpoint::open(&dir.0).unwrap();
    ckpt.validate().unwrap();
    let c = ckpt.config();
    assert_eq!((c.model_type, c.hidden_size, c.num_hidden_layers, c.head_dim), (ModelType::Llama, 128, 2, 64));
    assert_eq!(ckpt.generation_config().unwrap().eos_token_ids, vec![2, 3]);
    assert_eq!(ckpt.files().count(), 1);
    assert_eq!(ckpt.tensor_names().count(), tensors.len());
    assert_eq!(ckpt.lm_head_name(), "lm_head.weight");

    let embed = ckpt.tensor("model.embed_tokens.weight").unwrap();
    assert_eq!((embed.dtype(), embed.shape()), (Dtype::BF16, &[300, 128][..]));
    assert_eq!(embed.data(), find(&tensors, "model.embed_tokens.weight").bytes.as_slice());

    let w = LayerWeights::from_checkpoint(&ckpt, 1).unwrap();
    assert_eq!(w.wq, bf16s(find(&tensors, "model.layers.1.self_attn.q_proj.weight")));
    assert_eq!(w.w_down, bf16s(find(&tensors, "model.layers.1.mlp.down_proj.weight")));
    assert_eq!(w.mlp_norm, bf16s(find(&tensors, "model.layers.1.post_attention_layernorm.weight")));
    assert!(LayerWeights::from_checkpoint(&ckpt, 2).is_err());
}

#[test]
fn sharded_index_loads() {
    let dir = TempDir::new("checkpoint-sharded");
    let config = tiny_config();
    let tensors = tensors_for(&config);
    write_checkpoint(&dir.0, &config, &tensors, 2);

    let ckpt = Checkpoint::open(&dir.0).unwrap();
    ckpt.validate().unwrap();
    assert_eq!(ckpt.files().count(), 2);
    assert!(ckpt.generation_config().is_none());
    let head = ckpt.tensor("lm_head.weight").unwrap();
    assert_eq!(head.data(), find(&tensors, "lm_head.weight").bytes.as_slice());
    let w = LayerWeights::from_checkpoint(&ckpt, 0).unwrap();
    assert_eq!(w.wk, bf16s(find(&tensors, "model.layers.0.self_attn.k_proj.weight")));
}

#[test]
fn index_naming_the_wrong_shard_is_an_error() {
    let dir = TempDir::new("checkpoint-bad-index");
    let config = tiny_config();
    let tensors = tensors_for(&config);
    write_checkpoint(&dir.0, &config, &tensors, 2);
    let path = dir.0.join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    index["weight_map"]["lm_head.weight"] = json!("model-00001-of-00002.safetensors");
    std::fs::write(&path, index.to_string()).unwrap();
    let m = Checkpoint::open(&dir.0).err().unwrap().to_string();
    assert!(m.contains("lm_head.weight") && m.contains("model-00001-of-00002"), "{m}");
}

#[test]
fn tied_embeddings_need_no_lm_head_and_untied_require_it() {
    let tied = with(tiny_config(), "tie_word_embeddings", json!(true));
    let tensors = tensors_for(&tied);
    assert!(tensors.iter().all(|t| t.name != "lm_head.weight"));
    let dir = TempDir::new("checkpoint-tied");
    write_checkpoint(&dir.0, &tied, &tensors, 1);
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    ckpt.validate().unwrap();
    assert_eq!(ckpt.lm_head_name(), "model.embed_tokens.weight");

    // The same weights under an untied config lack the output projection.
    let (e, m) = open_error(&tiny_config(), &tensors);
    assert!(matches!(e, Error::Checkpoint(_)) && m.contains("`lm_head.weight`"), "{m}");
}

/// `config.json` exactly as transformers 5.17's `save_pretrained` writes the `gqa_tied`
/// case of scripts/model_reference.py: `dtype`, not `torch_dtype`; RoPE in
/// `rope_parameters`, with `rope_theta` inside it and none at the top level.
const V5_GQA_TIED: &str = r#"{
  "architectures": [
    "LlamaForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "dtype": "bfloat16",
  "eos_token_id": 2,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 256,
  "initializer_range": 0.02,
  "intermediate_size": 688,
  "max_position_embeddings": 2048,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 8,
  "num_hidden_layers": 4,
  "num_key_value_heads": 2,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "rope_theta": 10000.0,
    "rope_type": "default"
  },
  "tie_word_embeddings": true,
  "transformers_version": "5.17.0",
  "use_cache": true,
  "vocab_size": 1000
}
"#;

/// The `gqa_llama31` case's `config.json` as transformers 5.17 writes it: the llama3
/// scaling's parameters sit beside `rope_theta` in `rope_parameters`.
const V5_GQA_LLAMA31: &str = r#"{
  "architectures": [
    "LlamaForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 1,
  "dtype": "bfloat16",
  "eos_token_id": 2,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 512,
  "initializer_range": 0.02,
  "intermediate_size": 1024,
  "max_position_embeddings": 2048,
  "mlp_bias": false,
  "model_type": "llama",
  "num_attention_heads": 8,
  "num_hidden_layers": 2,
  "num_key_value_heads": 2,
  "pad_token_id": null,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_parameters": {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
    "rope_type": "llama3"
  },
  "tie_word_embeddings": false,
  "transformers_version": "5.17.0",
  "use_cache": true,
  "vocab_size": 2048
}
"#;

/// `generation_config.json` as transformers 5.17's `save_pretrained` writes it.
const V5_GENERATION: &str = r#"{
  "_from_model_config": true,
  "bos_token_id": 1,
  "eos_token_id": 2,
  "output_attentions": false,
  "output_hidden_states": false,
  "transformers_version": "5.17.0",
  "use_cache": true
}
"#;

#[test]
fn transformers_v5_tied_checkpoint_opens_without_lm_head() {
    let c = ModelConfig::from_json(V5_GQA_TIED).unwrap();
    assert_eq!((c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim), (256, 8, 2, 64));
    assert_eq!((c.q_dim(), c.kv_dim(), c.intermediate_size, c.vocab_size), (512, 128, 688, 1000));
    assert_eq!((c.rope_theta, c.rope_scaling.clone(), c.rms_norm_eps), (10000.0, None, 1e-5));
    assert_eq!((c.dtype, c.tie_word_embeddings, c.attention_bias), (Some(WeightDType::BF16), true, false));

    // The tensors (name and shape) of the file transformers wrote for this config,
    // embed_tokens first, then each layer and the final norm, with no lm_head.weight.
    let mut hf = vec![("model.embed_tokens.weight".to_string(), vec![1000, 256])];
    for l in 0..4 {
        for (name, shape) in [
            ("input_layernorm.weight", vec![256]),
            ("mlp.down_proj.weight", vec![256, 688]),
            ("mlp.gate_proj.weight", vec![688, 256]),
            ("mlp.up_proj.weight", vec![688, 256]),
            ("post_attention_layernorm.weight", vec![256]),
            ("self_attn.k_proj.weight", vec![128, 256]),
            ("self_attn.o_proj.weight", vec![256, 512]),
            ("self_attn.q_proj.weight", vec![512, 256]),
            ("self_attn.v_proj.weight", vec![128, 256]),
        ] {
            hf.push((format!("model.layers.{l}.{name}"), shape));
        }
    }
    hf.push(("model.norm.weight".to_string(), vec![256]));
    let mut ours: Vec<_> = expected_tensors(&c).into_iter().map(|t| (t.name, t.shape)).collect();
    ours.sort();
    hf.sort();
    assert_eq!(ours, hf);

    let dir = TempDir::new("checkpoint-v5-tied");
    let config: Value = serde_json::from_str(V5_GQA_TIED).unwrap();
    write_checkpoint(&dir.0, &config, &tensors_for(&config), 1);
    std::fs::write(dir.0.join("config.json"), V5_GQA_TIED).unwrap();
    std::fs::write(dir.0.join("generation_config.json"), V5_GENERATION).unwrap();
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    ckpt.validate().unwrap();
    assert!(ckpt.tensor_names().all(|n| n != "lm_head.weight"));
    assert_eq!(ckpt.lm_head_name(), "model.embed_tokens.weight");
    let g = ckpt.generation_config().unwrap();
    assert_eq!((g.bos_token_id, g.eos_token_ids.as_slice()), (Some(1), &[2][..]));

    // A bad `dtype` is named as written, not as the older `torch_dtype`.
    let m = ModelConfig::from_json(&V5_GQA_TIED.replace("\"bfloat16\"", "\"int8\"")).unwrap_err().to_string();
    assert!(m.contains("`dtype` `int8`"), "{m}");
}

#[test]
fn transformers_v5_llama3_rope_parameters_match_its_inv_freq() {
    let c = ModelConfig::from_json(V5_GQA_LLAMA31).unwrap();
    assert_eq!((c.rope_theta, c.dtype, c.tie_word_embeddings), (500000.0, Some(WeightDType::BF16), false));
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64,
    };
    assert_eq!(c.rope_scaling, Some(scaling));
    // transformers 5.17's `ROPE_INIT_FUNCTIONS["llama3"]` for this config (float32).
    #[rustfmt::skip]
    let hf = [
        1.0, 0.663601279258728, 0.44036662578582764, 0.20500096678733826, 0.07940301299095154,
        0.027751393616199493, 0.010674637742340565, 0.007083702366799116, 0.004700753837823868,
        0.003119426080957055, 0.0020700551103800535, 0.0013736911350861192, 0.0009115831344388425,
        0.0006049276562407613, 0.00040143076330423355, 0.00026638995041139424, 0.00017677668074611574,
        0.00011730923142749816, 7.784655463183299e-05, 5.165906986803748e-05, 3.428102354519069e-05,
        2.2748929040972143e-05, 1.5096217794052791e-05, 1.0017868589784484e-05, 6.647869668086059e-06,
        4.411534519022098e-06, 2.927499735960737e-06, 1.9426925064180978e-06, 1.289173155782919e-06,
        8.554969213037111e-07, 5.677088097399974e-07, 3.76732259610435e-07,
    ];
    let ours = c.rope_inv_freq();
    assert_eq!(ours.len(), hf.len());
    for (i, (o, h)) in ours.iter().zip(hf).enumerate() {
        assert!(((o - h) / h).abs() < 1e-6, "inv_freq[{i}]: ours {o}, transformers {h}");
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let config = tiny_config();
    let mut tensors = tensors_for(&config);
    tensors.retain(|t| t.name != "model.layers.1.mlp.up_proj.weight");
    let (e, m) = open_error(&config, &tensors);
    assert!(matches!(e, Error::Checkpoint(_)) && m.contains("`model.layers.1.mlp.up_proj.weight`"), "{m}");
}

#[test]
fn a_wrong_shape_names_the_tensor_and_both_shapes() {
    let config = tiny_config();
    let mut tensors = tensors_for(&config);
    let t = tensors.iter_mut().find(|t| t.name == "model.layers.0.self_attn.k_proj.weight").unwrap();
    t.shape = vec![128, 64];
    let (e, m) = open_error(&config, &tensors);
    assert!(matches!(e, Error::Shape(_)), "{m}");
    assert!(m.contains("model.layers.0.self_attn.k_proj.weight") && m.contains("[128, 64]") && m.contains("[64, 128]"));
}

#[test]
fn f32_weights_convert_and_integer_weights_are_refused() {
    let config = tiny_config();
    let mut tensors = tensors_for(&config);
    let name = "model.layers.0.input_layernorm.weight";
    let t = tensors.iter_mut().find(|t| t.name == name).unwrap();
    let values: Vec<f32> = (0..128).map(|i| 1.0 + i as f32 / 128.0).collect();
    (t.dtype, t.bytes) = (Dtype::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect());
    let dir = TempDir::new("checkpoint-f32");
    write_checkpoint(&dir.0, &config, &tensors, 1);
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    ckpt.validate().unwrap();
    let w = LayerWeights::from_checkpoint(&ckpt, 0).unwrap();
    assert_eq!(w.attn_norm, values.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>());

    let t = tensors.iter_mut().find(|t| t.name == name).unwrap();
    t.dtype = Dtype::I32;
    let (e, m) = open_error(&config, &tensors);
    assert!(matches!(e, Error::DType(_)) && m.contains(name), "{m}");
}

#[test]
fn bad_configs_name_the_field() {
    let cases = [
        ("num_key_value_heads", json!(3), "num_key_value_heads"),
        ("model_type", json!("gpt2"), "model_type"),
        ("head_dim", json!(96), "head_dim"),
        ("hidden_size", json!(132), "hidden_size"),
        ("intermediate_size", json!(0), "intermediate_size"),
        ("torch_dtype", json!("int8"), "torch_dtype"),
        ("hidden_act", json!("gelu"), "hidden_act"),
        ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
        ("rope_scaling", json!({"rope_type": "llama3", "factor": 8.0}), "rope_scaling.low_freq_factor"),
    ];
    for (key, value, field) in cases {
        let config = with(tiny_config(), key, value.clone());
        let e = ModelConfig::from_json(&config.to_string()).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, Error::Checkpoint(_)) && m.contains(&format!("`{field}`")), "{key} = {value}: {m}");
    }
    let mut missing = tiny_config();
    missing.as_object_mut().unwrap().remove("vocab_size");
    let m = ModelConfig::from_json(&missing.to_string()).unwrap_err().to_string();
    assert!(m.contains("`vocab_size`"), "{m}");
    // A folder with a bad config fails at open, before any weight is read.
    let dir = TempDir::new("checkpoint-bad-config");
    std::fs::write(dir.0.join("config.json"), with(tiny_config(), "head_dim", json!(96)).to_string()).unwrap();
    assert!(Checkpoint::open(&dir.0).err().unwrap().to_string().contains("`head_dim`"));
}

#[test]
fn qwen2_config_needs_qkv_biases() {
    let mut config = with(tiny_config(), "model_type", json!("qwen2"));
    config.as_object_mut().unwrap().remove("rope_scaling");
    let c = ModelConfig::from_json(&config.to_string()).unwrap();
    assert!(c.attention_bias && c.rope_scaling.is_none());
    let tensors = tensors_for(&config);
    let bias = find(&tensors, "model.layers.1.self_attn.k_proj.bias");
    assert_eq!(bias.shape, vec![64]);
    assert_eq!(find(&tensors, "model.layers.1.self_attn.q_proj.bias").shape, vec![128]);
    assert!(tensors.iter().all(|t| t.name != "model.layers.1.self_attn.o_proj.bias"));

    let dir = TempDir::new("checkpoint-qwen2");
    write_checkpoint(&dir.0, &config, &tensors, 1);
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    ckpt.validate().unwrap();
    assert_eq!(ckpt.tensor("model.layers.1.self_attn.k_proj.bias").unwrap().data(), bias.bytes.as_slice());
    LayerWeights::from_checkpoint(&ckpt, 1).unwrap();

    let without: Vec<Tensor> = tensors.into_iter().filter(|t| !t.name.ends_with("v_proj.bias")).collect();
    let (_, m) = open_error(&config, &without);
    assert!(m.contains("`model.layers.0.self_attn.v_proj.bias`"), "{m}");
}

/// A byte-level BPE `tokenizer.json` as Llama-3 and Qwen2 ship them, cut down to
/// the merges that spell "hello" (`Ġ` is the byte-level space).
const BPE_TOKENIZER: &str = r#"{
    "version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [{"id": 10, "content": "<|begin_of_text|>", "single_word": false, "lstrip": false,
                      "rstrip": false, "normalized": false, "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [10], "tokens": ["<|begin_of_text|>"]}}},
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
              "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
              "vocab": {"h": 0, "e": 1, "l": 2, "o": 3, "Ġ": 4, "he": 5, "ll": 6, "hell": 7, "hello": 8, "!": 9},
              "merges": ["h e", "l l", "he ll", "hell o"]}
}"#;

#[test]
fn tokenizer_round_trip() {
    let dir = TempDir::new("checkpoint-tokenizer");
    let config = tiny_config();
    write_checkpoint(&dir.0, &config, &tensors_for(&config), 1);
    std::fs::write(dir.0.join("tokenizer.json"), BPE_TOKENIZER).unwrap();
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    let t = ckpt.tokenizer().unwrap();
    let ids = t.encode("hello hello!", true).unwrap();
    assert_eq!(ids, vec![10, 8, 4, 8, 9]);
    assert_eq!(t.decode(&ids, true).unwrap(), "hello hello!");
    assert_eq!(t.decode(&ids, false).unwrap(), "<|begin_of_text|>hello hello!");
    assert_eq!((t.token_id("<|begin_of_text|>"), t.vocab_size()), (Some(10), 11));

    std::fs::remove_file(dir.0.join("tokenizer.json")).unwrap();
    let m = ckpt.tokenizer().err().unwrap().to_string();
    assert!(m.contains("tokenizer.json"), "{m}");
}

/// A tiny checkpoint with extra files (tokenizer_config.json and the like), opened.
fn checkpoint_with(name: &str, files: &[(&str, &str)]) -> (TempDir, Checkpoint) {
    let dir = TempDir::new(name);
    let config = tiny_config();
    write_checkpoint(&dir.0, &config, &tensors_for(&config), 1);
    for (file, text) in files {
        std::fs::write(dir.0.join(file), text).unwrap();
    }
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    (dir, ckpt)
}

/// The `chat_template` of Llama-3 instruct.
const LLAMA3_TEMPLATE: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}\
{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}\
{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// The `chat_template` of Qwen2 instruct (ChatML, with a default system turn).
const QWEN2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}\
{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}\
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// ChatML written over several lines, indented: only `trim_blocks` and
/// `lstrip_blocks` make the lines that hold just a block tag vanish.
const CHATML_MULTILINE: &str = "{% for message in messages %}
    {% if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] }}<|im_end|>
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
";

fn tokenizer_config(template: &str) -> String {
    json!({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": template}).to_string()
}

#[test]
fn llama3_chat_template_renders_like_transformers() {
    let (_dir, ckpt) = checkpoint_with("llama3-chat", &[("tokenizer_config.json", &tokenizer_config(LLAMA3_TEMPLATE))]);
    let t = ckpt.chat_template().unwrap().expect("a template");
    assert_eq!((t.bos_token(), t.eos_token()), (Some("<|begin_of_text|>"), Some("<|eot_id|>")));
    let messages = [Message::system("You are a helpful assistant."), Message::user("  What is 2+2?\n")];
    let turns = "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant.<|eot_id|>\
                 <|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>";
    assert_eq!(t.apply(&messages, false).unwrap(), turns);
    assert_eq!(t.apply(&messages, true).unwrap(), format!("{turns}<|start_header_id|>assistant<|end_header_id|>\n\n"));
}

#[test]
fn chatml_chat_templates_render_like_transformers() {
    // Qwen2's: a conversation without a system turn gets the default one.
    let config =
        json!({"eos_token": {"__type": "AddedToken", "content": "<|im_end|>"}, "chat_template": QWEN2_TEMPLATE});
    let (_dir, ckpt) = checkpoint_with("qwen2-chat", &[("tokenizer_config.json", &config.to_string())]);
    let t = ckpt.chat_template().unwrap().expect("a template");
    assert_eq!((t.bos_token(), t.eos_token()), (None, Some("<|im_end|>")));
    let messages = [Message::user("Hello!"), Message::assistant("Hi."), Message::user("Bye.")];
    assert_eq!(
        t.apply(&messages, true).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n\
         <|im_start|>assistant\nHi.<|im_end|>\n<|im_start|>user\nBye.<|im_end|>\n<|im_start|>assistant\n"
    );

    let (_dir, ckpt) =
        checkpoint_with("chatml-chat", &[("tokenizer_config.json", &tokenizer_config(CHATML_MULTILINE))]);
    let t = ckpt.chat_template().unwrap().expect("a template");
    let messages = [Message::system("Be brief."), Message::user("Hi")];
    assert_eq!(
        t.apply(&messages, true).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    assert_eq!(
        t.apply(&messages, false).unwrap(),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn raise_exception_is_a_checkpoint_error_with_its_message() {
    let template = "{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
                    {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
                    {% endif %}{{ message['content'] }}{% endfor %}";
    let (_dir, ckpt) = checkpoint_with("raise-chat", &[("tokenizer_config.json", &tokenizer_config(template))]);
    let t = ckpt.chat_template().unwrap().expect("a template");
    assert_eq!(t.apply(&[Message::user("a"), Message::assistant("b")], false).unwrap(), "ab");
    match t.apply(&[Message::user("a"), Message::user("b")], false) {
        Err(Error::Checkpoint(m)) => {
            assert!(m.contains("Conversation roles must alternate user/assistant/user/assistant/..."), "{m}")
        }
        other => panic!("expected a checkpoint error, got {other:?}"),
    }
}

#[test]
fn no_chat_template_is_none() {
    let (_dir, ckpt) = checkpoint_with("no-config-chat", &[]);
    assert!(ckpt.chat_template().unwrap().is_none());
    let config = json!({"bos_token": "<s>", "eos_token": "</s>"}).to_string();
    let (_dir, ckpt) = checkpoint_with("no-template-chat", &[("tokenizer_config.json", &config)]);
    assert!(ckpt.chat_template().unwrap().is_none());
}

#[test]
fn a_malformed_chat_template_names_the_field() {
    let unclosed = "{% for message in messages %}{{ message['content'] }";
    let (_dir, ckpt) = checkpoint_with("bad-chat", &[("tokenizer_config.json", &tokenizer_config(unclosed))]);
    let m = ckpt.chat_template().unwrap_err().to_string();
    assert!(m.contains("tokenizer_config.json") && m.contains("chat_template"), "{m}");

    let (_dir, ckpt) = checkpoint_with("bad-json-chat", &[("tokenizer_config.json", "{\"chat_template\": ")]);
    let m = ckpt.chat_template().unwrap_err().to_string();
    assert!(m.contains("tokenizer_config.json"), "{m}");
}

#[test]
fn chat_template_jinja_takes_precedence() {
    let config = tokenizer_config("ignored");
    let files = [("tokenizer_config.json", config.as_str()), ("chat_template.jinja", LLAMA3_TEMPLATE)];
    let (_dir, ckpt) = checkpoint_with("jinja-chat", &files);
    let t = ckpt.chat_template().unwrap().expect("a template");
    assert_eq!(
        t.apply(&[Message::user("Hi")], false).unwrap(),
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
    );
    let (_dir, ckpt) = checkpoint_with("bad-jinja-chat", &[("chat_template.jinja", "{% if %}")]);
    let m = ckpt.chat_template().unwrap_err().to_string();
    assert!(m.contains("chat_template.jinja"), "{m}");
}

/// Each rank's slice read from the mapped checkpoint equals the slice of the
/// whole layer, over a sharded index, with one row-parallel tensor in f32; an
/// uneven split is refused naming the dimension.
#[test]
fn tensor_parallel_shards_read_only_their_slices() {
    let config = with(with(tiny_config(), "num_attention_heads", json!(8)), "num_key_value_heads", json!(4));
    let mut tensors = tensors_for(&config);
    let name = "model.layers.1.mlp.down_proj.weight";
    let t = tensors.iter_mut().find(|t| t.name == name).unwrap();
    let values: Vec<f32> = random_with_outliers(7, 128 * 256, 0.02);
    (t.dtype, t.bytes) = (Dtype::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect());
    let dir = TempDir::new("checkpoint-tp");
    write_checkpoint(&dir.0, &config, &tensors, 2);
    let ckpt = Checkpoint::open(&dir.0).unwrap();
    let c = ckpt.config().layer_config();
    for layer in 0..2 {
        let whole = LayerWeights::from_checkpoint(&ckpt, layer).unwrap();
        for world in [1, 2, 4] {
            for plan in ShardPlan::all(&c, world).unwrap() {
                let mine = LayerWeights::shard_from_checkpoint(&ckpt, layer, &plan).unwrap();
                let want = whole.shard(&c, &plan).unwrap();
                let s = plan.shard_config(&c);
                assert_eq!((mine.wq.len(), mine.wo.len()), (s.q_dim() * s.d_model, s.d_model * s.q_dim()));
                assert_eq!((mine.w_down.len(), mine.attn_norm.len()), (s.d_model * s.d_ff, s.d_model));
                for (a, b) in [
                    (&mine.wq, &want.wq),
                    (&mine.wk, &want.wk),
                    (&mine.wv, &want.wv),
                    (&mine.wo, &want.wo),
                    (&mine.w_gate, &want.w_gate),
                    (&mine.w_up, &want.w_up),
                    (&mine.w_down, &want.w_down),
                    (&mine.mlp_norm, &want.mlp_norm),
                ] {
                    assert_eq!(a, b, "layer {layer}, rank {} of {world}", plan.rank);
                }
            }
        }
    }
    // Rank 1 of 2 holds the second half of down's columns, row by row.
    let p = ShardPlan::new(&c, 2, 1).unwrap();
    let down = LayerWeights::shard_from_checkpoint(&ckpt, 1, &p).unwrap().w_down;
    assert_eq!(down[..128], values[128..256].iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()[..]);
    let e = ShardPlan::new(&c, 8, 0).unwrap_err().to_string();
    assert!(e.contains("KV heads 4"), "{e}");
    let other = ShardPlan::new(&LayerConfig { d_ff: 512, ..c }, 2, 0).unwrap();
    assert!(LayerWeights::shard_from_checkpoint(&ckpt, 0, &other).is_err());
}
