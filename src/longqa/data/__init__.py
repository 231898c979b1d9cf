"""Data: the verl row schema, the LoongRL seed data, the offline generator and prompt preparation."""
