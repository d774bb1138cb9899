"""Text sources, the BPE tokenizer, and Grain pipelines that pack documents into training rows."""
