"""Answer quality of KV injection against prompt injection on LoCoMo-format conversational memory."""
