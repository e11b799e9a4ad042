"""Export trained runs to other formats: `ember export hf` writes a Hugging Face
transformers folder for the architectures that map onto one exactly."""
