"""The Hugging Face Hub: sources named by repo id, the content key, pulling a converted repo instead of
converting, the model card and upload. Imports `check` and below."""
