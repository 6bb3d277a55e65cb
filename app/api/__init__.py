"""HTTP layer: dependencies (`deps`), one router per concern (`routes`), the router (`main`)."""
