"""One rule per module. Every Rule subclass found here is registered automatically."""
