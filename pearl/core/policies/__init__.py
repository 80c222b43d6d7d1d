"""Decision policies: switching, borrowing and elastic rules, each chosen by name."""
