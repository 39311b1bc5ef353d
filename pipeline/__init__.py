"""pipeline package."""
