"""Publishing: the Hub-ready export (`export`), the official SGLang/vLLM layout (`official`) and the upload (`push`)."""
