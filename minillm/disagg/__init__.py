"""Chapter 9 — prefill/decode disaggregation: one engine prefills, another decodes, the KV cache moves between."""
