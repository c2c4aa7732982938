"""Gateway: the public endpoint. Owns the tokenizer, validation, routing and text streaming."""
