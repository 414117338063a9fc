// Shared by xtask (which writes the fingerprint next to the PTX) and by
// host/build.rs (which refuses to embed PTX whose fingerprint is stale).
// Kept dependency-free so that a build script can `include!` it.

/// Bump when the PTX build recipe changes in a way the sources do not show.
pub const RECIPE_VERSION: u32 = 1;

/// FNV-1a over the relative path and bytes of every file that shapes the PTX:
/// kernels/ and the abi/ crate it shares with the host.
pub fn kernels_fingerprint(kernels_dir: &std::path::Path) -> std::io::Result<u64> {
    let root = kernels_dir.parent().unwrap_or(kernels_dir);
    let mut files = Vec::new();
    for krate in ["kernels", "abi"] {
        collect_files(&root.join(krate).join("src"), &mut files)?;
        files.push(root.join(krate).join("Cargo.toml"));
    }
    files.sort();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325 ^ RECIPE_VERSION as u64;
    let mut feed = |bytes: &[u8]| {
        for &b in bytes {
            hash ^= b as u64;
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for file in &files {
        let rel = file.strip_prefix(root).unwrap_or(file);
        feed(rel.to_string_lossy().as_bytes());
        feed(&std::fs::read(file)?);
    }
    Ok(hash)
}

fn collect_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_files(&path, out)?;
        } else {
            out.push(path);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_when_any_source_byte_changes() {
        let root = std::env::temp_dir().join(format!("fp-test-{}", std::process::id()));
        for krate in ["kernels", "abi"] {
            std::fs::create_dir_all(root.join(krate).join("src/sub")).unwrap();
            std::fs::write(root.join(krate).join("Cargo.toml"), "[package]").unwrap();
            std::fs::write(root.join(krate).join("src/lib.rs"), "fn a() {}").unwrap();
        }
        std::fs::write(root.join("kernels/src/sub/m.rs"), "fn b() {}").unwrap();
        let first = kernels_fingerprint(&root.join("kernels")).unwrap();
        assert_eq!(first, kernels_fingerprint(&root.join("kernels")).unwrap());
        std::fs::write(root.join("kernels/src/sub/m.rs"), "fn c() {}").unwrap();
        let second = kernels_fingerprint(&root.join("kernels")).unwrap();
        assert_ne!(first, second);
        std::fs::write(root.join("abi/src/lib.rs"), "fn z() {}").unwrap();
        assert_ne!(second, kernels_fingerprint(&root.join("kernels")).unwrap());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
