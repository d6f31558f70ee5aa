//! Team tables: the team of every device for one team expression, computed once for all
//! ranks. Resolving a team rank by rank ([`Team::resolve`]) costs time linear in the mesh size,
//! and so does copying the member list into each event: quadratic over a large world (a
//! million-device `iota` took hours). A table costs one pass over the mesh.

use std::collections::HashMap;
use std::sync::Arc;

use meshflow_ir::{Arena, DeviceId, MeshDecl, MeshId, Team};

use super::events::{Instances, TeamId};

/// One team of a table: its members in team order, its first device outside the world (an
/// error), and its interned id
/// (interned when a rank first uses it, so ids are numbered in order of first use).
pub(crate) struct TableTeam {
    pub members: Arc<[DeviceId]>,
    pub outside: Option<DeviceId>,
    id: Option<TeamId>,
}

/// The teams of one team expression and the team of each device.
#[derive(Default)]
pub(crate) struct TeamTable {
    of: HashMap<DeviceId, usize>,
    teams: Vec<TableTeam>,
    world_size: usize,
}

impl TeamTable {
    /// Builds the table of `team` for a world of `world_size` ranks (empty when the team names an unknown mesh or a parallel
    /// type the mesh lacks: no device is in it).
    pub fn build(team: &Team, meshes: &Arena<MeshId, MeshDecl>, world_size: usize) -> TeamTable {
        let mut table = TeamTable {
            world_size,
            ..TeamTable::default()
        };
        match team {
            Team::Devices(devices) => table.push(devices.clone()),
            Team::Mesh(mesh) => {
                if let Some(decl) = meshes.get(*mesh) {
                    table.push(decl.mesh.devices().to_vec());
                }
            }
            Team::Flattened { mesh, pts } => {
                let Some(decl) = meshes.get(*mesh) else {
                    return table;
                };
                let mesh = &decl.mesh;
                if pts.is_empty() || pts.iter().any(|&pt| mesh.axis_of(pt).is_none()) {
                    return table;
                }
                // One pass: the devices sharing the coordinates off `pts`' axes form a team,
                // visited in row-major order of the whole mesh, which is row-major order of
                // the team's own axes.
                let shape = mesh.shape();
                let axes: Vec<usize> = pts.iter().filter_map(|&pt| mesh.axis_of(pt)).collect();
                let mut groups: HashMap<Vec<usize>, usize> = HashMap::new();
                let mut members: Vec<Vec<DeviceId>> = Vec::new();
                for (flat, &device) in mesh.devices().iter().enumerate() {
                    let mut rest = flat;
                    let mut key = vec![0usize; shape.len()];
                    for k in (0..shape.len()).rev() {
                        let e = shape[k].max(1);
                        if !axes.contains(&k) {
                            key[k] = rest % e;
                        }
                        rest /= e;
                    }
                    let next = members.len();
                    let g = *groups.entry(key).or_insert(next);
                    if g == next {
                        members.push(Vec::new());
                    }
                    members[g].push(device);
                }
                members.into_iter().for_each(|g| table.push(g));
            }
            Team::Slice { mesh, pt } => {
                let Some(decl) = meshes.get(*mesh) else {
                    return table;
                };
                let mesh = &decl.mesh;
                let Some(axis) = mesh.axis_of(*pt) else {
                    return table;
                };
                let shape = mesh.shape();
                let extent = shape.get(axis).copied().unwrap_or(0);
                let inner: usize = shape.iter().skip(axis + 1).product();
                if extent == 0 || inner == 0 {
                    return table;
                }
                // Row-major: a team fixes every coordinate but `axis`; walking the flat index
                // visits each team's members in axis order.
                let mut groups: Vec<Vec<DeviceId>> = vec![Vec::new(); mesh.size() / extent];
                for (flat, &device) in mesh.devices().iter().enumerate() {
                    let key = flat / (extent * inner) * inner + flat % inner;
                    if let Some(g) = groups.get_mut(key) {
                        g.push(device);
                    }
                }
                groups.into_iter().for_each(|g| table.push(g));
            }
        }
        table
    }

    fn push(&mut self, members: Vec<DeviceId>) {
        let index = self.teams.len();
        for &d in &members {
            self.of.entry(d).or_insert(index);
        }
        self.teams.push(TableTeam {
            outside: members.iter().copied().find(|&d| d >= self.world_size),
            members: members.into(),
            id: None,
        });
    }

    /// The team of `device` (interned in `out` on first use), or `None` when it is in none.
    pub fn team_of(
        &mut self,
        device: DeviceId,
        out: &mut Instances,
    ) -> Option<(TeamId, &TableTeam)> {
        let team = self.teams.get_mut(*self.of.get(&device)?)?;
        let id = *team
            .id
            .get_or_insert_with(|| out.intern_team(team.members.to_vec()));
        Some((id, team))
    }
}
