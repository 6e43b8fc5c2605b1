"""Model families (one file each), the registry of architectures, and loading."""
