//! Small Hugging Face checkpoints of seeded weights for the GPU tests, in
//! temporary folders.

use host::bf16;
use host::data::{cast, random_with_outliers};
use host::model::ModelConfig;
use safetensors::{tensor::TensorView, Dtype};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A folder under the system's temporary one, its own even among the
/// process's threads, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("host-{}-{n}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Writes a checkpoint of seeded weights into `dir`: projections 0.02·N with
/// outliers, norm weights near 1, embeddings 0.5·N so logits spread.
pub fn write_checkpoint(dir: &Path, config: &serde_json::Value) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let c = ModelConfig::from_json(&config.to_string()).unwrap();
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = host::model::expected_tensors(&c)
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let n: usize = t.shape.iter().product();
            let norm = t.name.ends_with("norm.weight");
            let scale = if norm {
                0.1
            } else if t.name.contains("embed") {
                0.5
            } else {
                0.02
            };
            let mut v = random_with_outliers(1000 + i as u64, n, scale);
            if norm {
                v.iter_mut().for_each(|x| *x += 1.0);
            }
            let b: Vec<bf16> = cast(&v);
            (t.name, t.shape, b.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect())
        })
        .collect();
    let views = tensors.iter().map(|(n, s, b)| (n.clone(), TensorView::new(Dtype::BF16, s.clone(), b).unwrap()));
    std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
}
