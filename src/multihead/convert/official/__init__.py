"""One module per official code base, named as ``convert.from_official`` names it; each has
``from_official(state_dict, **official_config)`` (and most ``to_official``)."""
