"""Data-parallel gradient handling."""
