"""The family interfaces models are written against; backends implement them."""
