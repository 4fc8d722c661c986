"""Text in and out of token ids: the GGUF's tokenizer (tokenizer, pretokenize), its chat template (chat), and the
built-in prompt sets (prompt_sets, prompts/*.jsonl)."""
