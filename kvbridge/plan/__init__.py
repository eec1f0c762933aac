"""Planning: KV layouts, who pulls what from whom, descriptors and ports."""
