//! Tokenizer files against transformers (`fixtures/flux_pipeline`: the ids FluxPipeline's
//! tokenizer calls gave for `prompt.json`'s prompt): from `tokenizer.json`, from CLIP's
//! `vocab.json` + `merges.txt` alone, and the errors for folders that cannot be read.

use std::path::{Path, PathBuf};

use ddo_cli::tokenize::PipelineTokenizers;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/flux_pipeline")
}

fn prompt() -> (String, usize) {
    let text = std::fs::read_to_string(dir().join("prompt.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    (
        v["prompt"].as_str().unwrap().to_string(),
        v["max_sequence_length"].as_u64().unwrap() as usize,
    )
}

fn ids(name: &str) -> Vec<u32> {
    let (_, v) = ddo_nn::read_f32_tensor(&dir().join("outputs.safetensors"), name).unwrap();
    v.iter().map(|&x| x as u32).collect()
}

fn copy(from: &Path, to: &Path, files: &[&str]) {
    std::fs::create_dir_all(to).unwrap();
    for f in files {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

#[test]
fn tokenizer_files_give_transformers_ids() {
    let (text, max_seq) = prompt();
    let t = PipelineTokenizers::load(&dir())
        .unwrap()
        .expect("tokenizers");
    assert_eq!(t.clip.model_max_length, Some(16));
    let (clip, t5) = t.encode(&text, 77, max_seq).unwrap();
    assert_eq!(clip, ids("text_clip_input_ids_f32"));
    assert_eq!(t5, ids("text_t5_input_ids_f32"));
}

#[test]
fn clip_from_vocab_and_merges_matches_too() {
    let (text, max_seq) = prompt();
    let tmp = std::env::temp_dir().join(format!("ddo-tok-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    copy(
        &dir().join("tokenizer"),
        &tmp.join("tokenizer"),
        &["vocab.json", "merges.txt", "tokenizer_config.json"],
    );
    copy(
        &dir().join("tokenizer_2"),
        &tmp.join("tokenizer_2"),
        &["tokenizer.json", "tokenizer_config.json"],
    );
    let t = PipelineTokenizers::load(&tmp).unwrap().expect("tokenizers");
    assert!(t.clip.source.ends_with("vocab.json"));
    let (clip, _) = t.encode(&text, 77, max_seq).unwrap();
    assert_eq!(clip, ids("text_clip_input_ids_f32"));
    // Longer limits pad with the pad token (CLIP: <|endoftext|> = 99; T5: <pad> = 0).
    let (clip, t5) = t
        .clip
        .encode("the cat", 8)
        .and_then(|c| Ok((c, t.t5.encode("the cat", 6)?)))
        .unwrap();
    assert_eq!(clip[0], 98);
    assert!(clip[3..].iter().all(|&i| i == 99), "{clip:?}");
    assert_eq!(t5.len(), 6);
    assert_eq!(
        t5[t5.iter().position(|&i| i == 1).unwrap() + 1..],
        [0, 0, 0]
    );

    // A T5 folder with no tokenizer.json is an error that says what to do.
    std::fs::remove_file(tmp.join("tokenizer_2/tokenizer.json")).unwrap();
    let e = PipelineTokenizers::load(&tmp).unwrap_err();
    assert!(e.message.contains("tokenizer.json"), "{e}");
    assert!(e.message.contains("hint"), "{e}");
    // Without the folders: None (the stand-in is used).
    std::fs::remove_dir_all(tmp.join("tokenizer_2")).unwrap();
    assert!(PipelineTokenizers::load(&tmp).unwrap().is_none());
    let _ = std::fs::remove_dir_all(&tmp);
}
