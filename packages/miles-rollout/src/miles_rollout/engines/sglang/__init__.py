"""`sglang` engine: SGLang HTTP servers driven through SGLang's native API."""
