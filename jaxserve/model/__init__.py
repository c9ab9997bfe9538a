"""Device side: weights pytrees and pure functions over them."""
