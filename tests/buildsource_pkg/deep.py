class Other:
    """Imported by name from a dotted module (``from buildsource_pkg.deep import Other``)."""
